"""Host git in the credential broker (R1, R2): what a failed fetch or push means, and the
mirrors behind the workspaces. The runner and the askpass helper they use are shared with
the CLI's pre-flight checks: services/common/host/gitcmd.py and services/common/host/askpass.py."""
