"""The operator's transparency log, its witness and its monitor, over `attestation.transparency`'s formats.

`log` appends release and key statements to a directory of static tiles, entry bundles and a
signed checkpoint, which any HTTP file server can serve (`apps.log_app` is a read-only one);
`witness` cosigns a log's checkpoints only when each is consistent with the last it cosigned;
`audit` fetches a whole log, recomputes it and reports what it holds. The commands are `veil log`,
`veil witness` and `veil audit report transparency` (`cli`, `audit_cli`).

A log is public and its witnesses are run by others than its operator, so this package imports no
other party's code (gateway, relay, issuer); the SDK and the node never import it, reading proofs with
`attestation.transparency` alone.
"""
