"""Helpers shared by several test areas (real servers, fakes of remote APIs)."""
