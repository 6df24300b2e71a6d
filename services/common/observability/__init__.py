"""Logs, metrics (bounded labels, R25), traces (R26) and the ops endpoints every process
serves."""
