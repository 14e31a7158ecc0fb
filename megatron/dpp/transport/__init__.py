"""Mailbox channels between pipeline stages."""
