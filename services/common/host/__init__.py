"""The operator's machine as afe finds and uses it, the same way in every process and in the
entry points (the CLI's pre-flight checks, the launcher): the local Docker images afe builds
(images.py), the mount table (mountinfo.py), host git run safely (gitcmd.py: the runner;
askpass.py: the askpass helper; gitrepo.py: where a repository keeps its refs) and the
operator's proxy choice for a URL (proxies.py)."""
