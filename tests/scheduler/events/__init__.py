"""Tests of services/scheduler/events: the event log, its fast paths and its writes across outages."""
