"""Building the gateway's token gate from the measured policy and the gateway's settings.

The policy names the issuer and the SHA-256 ids of the keys whose tokens are
accepted; the keys themselves come from the issuer's directory (a file or an
http(s) URL), and only those whose id the policy lists are trusted. A key the
issuer publishes but the policy does not list is ignored, so an issuer cannot
introduce a key (for example one per user, to tell users apart) without a
policy change that every node measures and every client sees.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from gateway.auth import ProcessSpentTokens, TokenGate
from gateway.errors import GatewaySettingsError
from gateway.settings import GatewaySettings
from gateway.spent_tokens import open_spent_tokens
from ohttp.privacypass import PrivacyPassError, TokenChallenge, TokenKey, decode_directory
from ohttp.privacypass.directory import MAX_DIRECTORY_BYTES
from policy import Policy


def token_gate_for(policy: Policy, settings: GatewaySettings) -> TokenGate | None:
    """The gate for `policy`, or None when it lists no issuer key (every request is admitted)."""
    authorization = policy.authorization
    if not authorization.issuer_keys:
        if settings.origin or settings.issuer_directory or settings.spent_tokens:
            # Else an operator who set up tokens would run a gateway that asks nobody for one.
            raise GatewaySettingsError("--origin, --issuer-directory and --spent-tokens apply only when the policy "
                                       "lists issuer keys ([authorization] issuer_keys); this one lists none, so no "
                                       "request would need a token")
        return None
    if not authorization.issuer_name or not settings.origin or not settings.issuer_directory:
        raise GatewaySettingsError("the policy demands tokens: set authorization.issuer_name in the policy and "
                                   "the gateway's origin and issuer directory (--origin, --issuer-directory)")
    trusted = listed_keys(read_directory(settings.issuer_directory), authorization.issuer_keys)
    if settings.spent_tokens:
        spent = open_spent_tokens(settings.spent_tokens)
    else:
        print("veil gateway: spent tokens are kept in this process only; run one gateway process, "
              "or give every process the same --spent-tokens store", file=sys.stderr)
        spent = ProcessSpentTokens()
    challenge = TokenChallenge(issuer_name=authorization.issuer_name, origin_info=(settings.origin,))
    return TokenGate(challenge=challenge, trusted=trusted, spent=spent, retry_after_s=settings.retry_after_s)


def listed_keys(published: tuple[TokenKey, ...], listed_ids: tuple[str, ...]) -> dict[bytes, TokenKey]:
    """The published keys whose id the policy lists; refuses to run with none of them."""
    trusted = {key.key_id: key for key in published if key.key_id.hex() in listed_ids}
    if not trusted:
        raise GatewaySettingsError("the issuer directory holds none of the keys the policy lists; "
                                   "check authorization.issuer_keys against the ids `veil issuer` prints")
    return trusted


def read_directory(source: str) -> tuple[TokenKey, ...]:
    """The token keys of the issuer directory at `source` (a file path or an http(s) URL)."""
    try:
        if source.startswith(("http://", "https://")):
            response = httpx.get(source, timeout=10.0, trust_env=False)
            response.raise_for_status()
            body = response.content[: MAX_DIRECTORY_BYTES + 1]
        else:
            body = Path(source).read_bytes()[: MAX_DIRECTORY_BYTES + 1]
        return tuple(key.token_key for key in decode_directory(body).keys)
    except (OSError, httpx.HTTPError) as error:
        raise GatewaySettingsError(f"cannot fetch the issuer directory ({type(error).__name__}); "
                                   "check --issuer-directory") from None
    except PrivacyPassError:
        raise GatewaySettingsError("the issuer directory is not a valid RFC 9578 directory") from None
