"""Root certificates Veil knows by content, for collectors that must complete a chain.

Verification never trusts these by inclusion here: a root is trusted only when
its SHA-256 fingerprint is pinned in the policy.
"""

from __future__ import annotations

# AMD's root keys (ARK), one per SEV-SNP product line, SHA-256 of the DER certificate
# served by AMD KDS (/vcek/v1/{product}/cert_chain). Milan: go-sev-guest's
# verify/trust/ask_ark_milan.pem; Genoa: the ARK-Genoa of its verify/trust/ask_ark_genoa_vlek.pem.
# Turin (EPYC 9005): the ARK-Turin of go-sev-guest's verify/trust/ask_ark_turin_vcek.pem ("source:
# https://kdsintf.amd.com/vcek/v1/Turin/cert_chain", commit 6953342, 2024), the same DER as virtee/sev's
# src/certs/snp/builtin/turin/ark.pem and confidential-containers/trustee's
# deps/verifier/src/snp/turin_ask_ark_asvk.pem (tests/data/amd-ask-ark-turin.pem; SECURITY.md, "ARK-Turin").
AMD_ARK_FINGERPRINTS: dict[str, str] = {
    "Milan": "69d063b45344d26a2e94e1f4210de49ef555308287d4c174445c95639a540bcd",
    "Genoa": "4c6598d19c18719c5dfd4a7d335f674e5bfe1d8f800cea2cf270c10d103db2f1",
    "Turin": "1f084161a44bb6d93778a904877d4819cafa5d05ef4193b2ded9dd9c73dd3f6a",
}

# Intel SGX Root CA: the root of every PCK certificate chain (TDX quotes).
INTEL_SGX_ROOT_CA_FINGERPRINT = "44a0196b2b99f889b8e149e95b807a350e7424964399e885a7cbb8ccfab674d3"

# NVIDIA Device Identity CA: the root of every H100/H200 device certificate chain.
NVIDIA_DEVICE_IDENTITY_CA_FINGERPRINT = "102bf659d5419614c9d8e6aecebc80454eb26b1df6a769ac720b9a690b167b48"
NVIDIA_DEVICE_IDENTITY_CA_PEM = b"""\
-----BEGIN CERTIFICATE-----
MIICCzCCAZCgAwIBAgIQLTZwscoQBBHB/sDoKgZbVDAKBggqhkjOPQQDAzA1MSIw
IAYDVQQDDBlOVklESUEgRGV2aWNlIElkZW50aXR5IENBMQ8wDQYDVQQKDAZOVklE
SUEwIBcNMjExMTA1MDAwMDAwWhgPOTk5OTEyMzEyMzU5NTlaMDUxIjAgBgNVBAMM
GU5WSURJQSBEZXZpY2UgSWRlbnRpdHkgQ0ExDzANBgNVBAoMBk5WSURJQTB2MBAG
ByqGSM49AgEGBSuBBAAiA2IABA5MFKM7+KViZljbQSlgfky/RRnEQScW9NDZF8SX
gAW96r6u/Ve8ZggtcYpPi2BS4VFu6KfEIrhN6FcHG7WP05W+oM+hxj7nyA1r1jkB
2Ry70YfThX3Ba1zOryOP+MJ9vaNjMGEwDwYDVR0TAQH/BAUwAwEB/zAOBgNVHQ8B
Af8EBAMCAQYwHQYDVR0OBBYEFFeF/4PyY8xlfWi3Olv0jUrL+0lfMB8GA1UdIwQY
MBaAFFeF/4PyY8xlfWi3Olv0jUrL+0lfMAoGCCqGSM49BAMDA2kAMGYCMQCPeFM3
TASsKQVaT+8S0sO9u97PVGCpE9d/I42IT7k3UUOLSR/qvJynVOD1vQKVXf0CMQC+
EY55WYoDBvs2wPAH1Gw4LbcwUN8QCff8bFmV4ZxjCRr4WXTLFHBKjbfneGSBWwA=
-----END CERTIFICATE-----"""
