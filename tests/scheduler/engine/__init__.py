"""Tests of services/scheduler/engine: approvals, cancel, capacity, leases and takeovers, durability."""
