"""Consumers of the derived streams: ``refinery alerts tail`` and webhook forwarding."""
