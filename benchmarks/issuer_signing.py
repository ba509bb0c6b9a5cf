"""The issuer's signing rate: Privacy Pass token responses per second on one core.

Run: .venv/bin/python benchmarks/issuer_signing.py [--seconds S]

Answers real type 2 token requests (2048-bit RSA, RFC 9578) the way the issuer does
(`answer_token_request`: decode, mask, the private operation in OpenSSL, or GMP where no
OpenSSL 3 is found, check, unmask), on one
thread, and prints tokens/s beside the baseline measured in the same run: the pure-Python
big-integer path the issuer used before (the same masking, CRT and check, with Python's `pow`).
Also prints OpenSSL's own RSA private operation on the same key (PKCS#1 v1.5 signing, which adds
padding: blind signing needs the raw operation, which `cryptography` does not offer) for scale.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives import hashes  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import padding, rsa  # noqa: E402

from ohttp.privacypass import TokenChallenge, answer_token_request, begin_issuance, issuer_key  # noqa: E402
from ohttp.privacypass.blind_rsa import GmpCrt, _random_unit, modulus_length  # noqa: E402
from ohttp.privacypass.pss import i2osp, os2ip  # noqa: E402

TARGET_PER_CORE = 2000


def pure_python_blind_sign(private_key: rsa.RSAPrivateKey, blinded_msg: bytes) -> bytes:
    """The signing path before GMP: Python integers throughout, the key's numbers read per request."""
    numbers = private_key.private_numbers()
    n, e = numbers.public_numbers.n, numbers.public_numbers.e
    m = os2ip(blinded_msg)
    mask = _random_unit(n)
    masked = (m * pow(mask, e, n)) % n
    s_p, s_q = pow(masked, numbers.dmp1, numbers.p), pow(masked, numbers.dmq1, numbers.q)
    s = ((s_q + (numbers.iqmp * (s_p - s_q)) % numbers.p * numbers.q) * pow(mask, -1, n)) % n
    if pow(s, e, n) != m:
        raise RuntimeError("wrong result")
    return i2osp(s, modulus_length(private_key.public_key()))


def rate(sign: Callable[[bytes], object], requests: list[bytes], seconds: float) -> float:
    """Calls per CPU-second of this thread (`time.thread_time`: a rate per core that other processes
    on a shared machine do not lower) of `sign` over `requests`, cycled for at least `seconds` of CPU."""
    done, start = 0, time.thread_time()
    while time.thread_time() - start < seconds:
        for request in requests:
            sign(request)
        done += len(requests)
    return done / (time.thread_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="time spent measuring each path (default 3)")
    arguments = parser.parse_args()
    private_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    key = issuer_key(private_key)
    challenge = TokenChallenge(issuer_name="issuer.example", origin_info=("gateway.example",))
    pending = [begin_issuance(key.token_key, challenge) for _ in range(32)]
    bodies = [p.request.encode() for p in pending]
    blinded = [p.request.blinded_msg for p in pending]

    baseline = rate(lambda msg: pure_python_blind_sign(private_key, msg), blinded, arguments.seconds)
    issuer = rate(lambda body: answer_token_request([key], body), bodies, arguments.seconds)
    gmp_key = dataclasses.replace(key, signer=dataclasses.replace(key.signer, private=GmpCrt.of(private_key)))
    gmp = rate(lambda body: answer_token_request([gmp_key], body), bodies, arguments.seconds)
    openssl = rate(lambda msg: private_key.sign(msg, padding.PKCS1v15(), hashes.SHA256()), blinded,
                   arguments.seconds)
    verdict = "met" if issuer >= TARGET_PER_CORE else "NOT met"
    backend = key.signer.private.name
    print("issuer signing, RSA-2048 blind signatures, one thread, per CPU-second")
    print(f"pure-Python path (before)     {baseline:8.0f} tokens/s  {1000 / baseline:6.3f} ms/token")
    print(f"issuer path ({backend:7})       {issuer:8.0f} tokens/s  {1000 / issuer:6.3f} ms/token")
    print(f"issuer path, GMP fallback     {gmp:8.0f} tokens/s  {1000 / gmp:6.3f} ms/token")
    print(f"OpenSSL RSA sign (for scale)  {openssl:8.0f} signs/s   {1000 / openssl:6.3f} ms/sign")
    print(f"speed-up over the pure-Python path: {issuer / baseline:.1f}x")
    print(f"issuer path: {issuer:.0f} tokens/s  [target >= {TARGET_PER_CORE}/s per core: {verdict}]")


if __name__ == "__main__":
    main()
