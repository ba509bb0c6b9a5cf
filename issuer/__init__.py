"""The token issuer: a separate service the operator runs to sell anonymous access (RFC 9578, token type 2).

It authenticates an account, counts its tokens against a quota and blindly
signs token requests; it never sees a token, so it cannot tell the gateway
which account sent which request. It keeps per-account counters and nothing
else: no nonce, no blinded message, no signature. It imports nothing of the
gateway or the relay: what it shares with them is how a Veil server serves
(`serving`). It logs the keys it publishes in the operator's transparency log
(`transparency`), as any publisher of statements does.
"""
