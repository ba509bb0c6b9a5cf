"""Veil's anonymizing gateway: attested directory, anonymous relay and uniform random router.

The gateway never decrypts. It admits a node only after the node's evidence,
bound to a fresh gateway nonce, verifies under the gateway's policy
(`pool`, `keeper`); publishes the same directory to every caller
(`directory`); forwards one of a client's K encapsulations, chosen uniformly
at random among the healthy candidates, with nothing about the client attached
(`routing`, `forwarding`, `node_client`); bounds requests in flight instead of
queueing them (`serving.backpressure`); admits requests for nodes only from its
relays when told to (`relay_only`); and audits each route with node ids, outcome
and a coarse latency only (`audit`). Anonymous authorization plugs in at
`auth`. The application is `gateway.app.create_app(GatewaySettings)`; the
command line is `veil gateway` (`cli`).

The relay, the issuer and the transparency log are other parties' and have
packages of their own (`relay`, `issuer`, `transparency`); the gateway imports
none of them, and shares with them only how a Veil server serves (`serving`).

Modules are imported on use so that `veil --help` stays light.
"""
