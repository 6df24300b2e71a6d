"""Fencing (R37, R45): the fences the broker checks before a push, a pull request or a
merge, on a file and in the deployment's database."""
