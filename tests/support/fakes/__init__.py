"""Local HTTP servers speaking other services' APIs (git smart HTTP, GitHub
REST, OpenAI Chat Completions, Anthropic Messages), for tests only. Each
binds 127.0.0.1 on a free port and records what it was sent."""
