"""Tests of services/scheduler/store: the store on SQLite and PostgreSQL, migrations, outages, fencing."""
