"""Tests of services/scheduler/sandboxes: the broker clients, the warm pool, reconcile, remote hosts."""
