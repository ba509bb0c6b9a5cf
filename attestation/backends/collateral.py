"""The CPU vendor's certificates and CRLs a node staples to its CPU TEE evidence.

The node's operator fetches them ahead of time (and refreshes the CRLs
regularly) into one folder, `$VEIL_CPU_COLLATERAL_DIR` or
/etc/veil/cpu-collateral; verifiers never go online. File names, and where
each comes from:

SEV-SNP, from AMD KDS (https://kdsintf.amd.com):
  vcek.der        /vcek/v1/{product}/{CHIP_ID hex}?blSPL=…&teeSPL=…&snpSPL=…&ucodeSPL=…
                  (this chip's VCEK at its REPORTED_TCB; Turin: /vcek/v1/Turin/{first 8 bytes of
                  CHIP_ID, hex}?fmcSPL=…&blSPL=…&teeSPL=…&snpSPL=…&ucodeSPL=…, KDS answers 404 to the
                  64-byte form)
  cert_chain.pem  /vcek/v1/{product}/cert_chain   (the ASK, then the ARK)
  crl.der         /vcek/v1/{product}/crl          (the ARK's CRL)
TDX, from Intel PCS:
  pck-crl.der     https://api.trustedservices.intel.com/sgx/certification/v4/pckcrl?ca=platform&encoding=der
                  (ca=processor for a PCK issued by the Processor CA)
  root-crl.der    https://certificates.trustedservices.intel.com/IntelSGXRootCA.der
  tcb-info.json   https://api.trustedservices.intel.com/tdx/certification/v4/tcb?fmspc={FMSPC}
                  (the response body exactly as served: its signature covers the bytes)
  qe-identity.json  https://api.trustedservices.intel.com/tdx/certification/v4/qe/identity
  tcb-signing-chain.pem  the TCB-Info-Issuer-Chain response header, URL-decoded (TCB Signing, then root)
A TDX quote embeds its PCK chain, so no PCK certificate file is needed. TCB Info and QE Identity are
reissued every 30 days: refresh them (and the CRLs) before the policy's maximum age, or the node's
evidence is refused at its next attestation.
"""

from __future__ import annotations

import os
from pathlib import Path

from attestation.bundle import TdxCollateral
from attestation.certs import pem_chain_to_der
from attestation.errors import BackendError, ChainError

COLLATERAL_DIR_ENV = "VEIL_CPU_COLLATERAL_DIR"
DEFAULT_COLLATERAL_DIR = Path("/etc/veil/cpu-collateral")
CRL_FILES: dict[str, tuple[str, ...]] = {"sev-snp": ("crl.der",), "tdx": ("pck-crl.der", "root-crl.der")}


def collateral_dir() -> Path:
    """The folder the operator keeps the CPU vendor's certificates and CRLs in."""
    return Path(os.environ.get(COLLATERAL_DIR_ENV, DEFAULT_COLLATERAL_DIR))


def load_collateral(kind: str, folder: Path) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """(certificate chain, CRLs) to staple to a `kind` ("tdx", "sev-snp") report, read from `folder`."""
    crls = tuple(_read(folder, name) for name in CRL_FILES[kind])
    if kind == "tdx":
        return (), crls
    ask_ark = _pair_chain(folder, "cert_chain.pem", "AMD KDS's PEM cert_chain (ASK, then ARK)",
                          "the ASK then the ARK, as AMD KDS serves it")
    return (_read(folder, "vcek.der"), *ask_ark), crls


def load_tdx_collateral(folder: Path) -> TdxCollateral:
    """Intel PCS's TCB Info and QE Identity, and their issuer chain, to staple to a TDX quote."""
    chain = _pair_chain(folder, "tcb-signing-chain.pem", "a PEM chain (TCB Signing, then the root)",
                        "the TCB Signing certificate then the root")
    return TdxCollateral(_read(folder, "tcb-info.json"), _read(folder, "qe-identity.json"), chain)


def _pair_chain(folder: Path, name: str, kind: str, order: str) -> tuple[bytes, ...]:
    """The two DER certificates of the PEM file `name` (a signer, then its issuer), refused naming the file."""
    try:
        chain = pem_chain_to_der(_read(folder, name))
    except ChainError:
        raise BackendError(f"{folder}/{name} is not {kind}") from None
    if len(chain) != 2:
        raise BackendError(f"{folder}/{name} must hold {order}")
    return chain


def _read(folder: Path, name: str) -> bytes:
    try:
        return (folder / name).read_bytes()
    except OSError as error:
        raise BackendError(
            f"cannot read {folder / name} ({error.strerror}): fetch it from the CPU vendor into "
            f"${COLLATERAL_DIR_ENV} (see attestation/backends/collateral.py)"
        ) from None
