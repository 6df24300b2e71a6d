"""Work from GitHub: webhook deliveries at the scheduler's edge
(delivery.py, hooks.py), Trigger matching and one ticket per issue
(intake.py), review and CI iteration on afe's pull requests (iteration.py and
the CI modules), polling (poll.py), reporting back (report.py), and what the
intake did with an event (outcome.py).

May import: services.common, the generated contracts, and the scheduler's
store, events, sandboxes, executor and engine.
"""
