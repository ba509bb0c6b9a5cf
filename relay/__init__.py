"""Veil's OHTTP relay (RFC 9458 section 4): the party that sees client addresses, and nothing else.

Run by someone other than the gateway's operator, the relay forwards sealed requests and the
directory to one gateway with no client address and no client header but a Privacy Pass token, and
streams the answers back (`app`). It imports nothing of the gateway: what it shares with it is how
a Veil server serves (`serving`) and the paths of the gateway's REST API (`protocol.constants`).
The command line is `veil relay` (`cli`).
"""
