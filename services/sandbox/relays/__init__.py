"""Forwarders inside a sandbox from its loopback to the broker's relay sockets, and the
one-thread relay of stream connections they run."""
