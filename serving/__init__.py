"""How every Veil party's HTTP server serves: the gateway, the relay, the issuer, the log and the witness.

No party owns this package and it imports none of them, so a relay operator reads what the relay runs
without the gateway's code. It holds what each server needs alike: uvicorn with no access log and
deadlines for a request's head and body (`server`), where to listen and the connection bounds
(`settings`), fixed error answers that never reflect a request (`errors`, `responses`), liveness,
readiness and metrics routes (`probes`), bounded requests in flight (`backpressure`), and the checks of
an OHTTP request made before its body is read (`ohttp_requests`).
"""
