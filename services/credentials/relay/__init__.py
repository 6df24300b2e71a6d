"""The key-free model relay (R32): an agent in a sandbox reaches its model through the
broker, which adds the key, holds the limits and counts usage."""
