"""The gRPC layer every process shares: servers and channels, the link guard and the
callers' table, mTLS between hosts, interceptors and status conventions."""
