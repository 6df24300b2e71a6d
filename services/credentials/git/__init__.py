"""Host git, run safely (R1, R2): the askpass helper, the git command runner, what a failed
fetch or push means, and the mirrors behind the workspaces."""
