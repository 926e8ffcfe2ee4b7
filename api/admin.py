"""The admin API (our extension; OpenAI's Admin API plays the same part for its projects):
organisations, API keys and every organisation's usage, over HTTP, for admin keys only.

    GET    /v1/admin/organizations             list
    POST   /v1/admin/organizations             {"name", "tier", "budget_usd"?, "limits"?}
    GET    /v1/admin/organizations/{name}      one, with this month's spend
    PATCH  /v1/admin/organizations/{name}      {"tier"?, "budget_usd"? (null: none),
                                                "limits"? (a value null removes that one; null: all)}
    GET    /v1/admin/keys?organization=NAME    list (prefix and last four characters, never the secret)
    POST   /v1/admin/keys                      {"organization", "name"?, "scope"?, "expires_in_days"?}
                                               -> the key with its secret in "value", shown this once
    DELETE /v1/admin/keys/{id or prefix}       revoke
    GET    /v1/admin/usage?group_by=org|key|model|day&organization=NAME&start=&end=

An admin key (`server.py keys create --scope admin`, or POST /v1/admin/keys with
"scope": "admin") reaches these routes and nothing else; every other key, and the keyless
local mode, gets 403 or 401 here (api/security.py). Each change is logged (`admin_change`) with
the admin key that made it, and takes effect on the next request: this process's key cache is
cleared by the store on every key or organisation write.
"""

from __future__ import annotations

import re
import time
from typing import Any

import structlog
from aiohttp import web

from api.chat import read_json
from api.errors import ApiError, bad_request, not_found
from api.resources import month_start, time_param, usage_body
from api.state import PRINCIPAL, SETTINGS, STATE
from settings import ORG_LIMITS, merge_org_limits
from store.keys import MAX_BUDGET_USD, MAX_EXPIRES_IN_DAYS, MAX_ORG_NAME_CHARS, key_name_problem
from store.ledger import GROUP_BY
from store.store import UNSET
from store.types import INFERENCE_SCOPE, KEY_SCOPES, ApiKey, Conflict, NotFound, Org

log = structlog.get_logger(__name__)

MAX_NAME_CHARS = 64
ORG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ORG_CREATE_FIELDS = ("name", "tier", "budget_usd", "limits")
_ORG_UPDATE_FIELDS = ("tier", "budget_usd", "limits")
_KEY_CREATE_FIELDS = ("organization", "name", "scope", "expires_in_days")


# -- objects -----------------------------------------------------------------------------
def org_obj(org: Org, *, month_spend_usd: float | None = None) -> dict:
    obj = {
        "object": "organization",
        "id": org.id,
        "name": org.name,
        "tier": org.tier,
        "budget_usd": org.budget_usd,
        "limits": org.limits,
        "created_at": org.created_at,
    }
    if month_spend_usd is not None:
        obj["month_spend_usd"] = month_spend_usd
    return obj


def key_obj(key: ApiKey, org_name: str, now: float) -> dict:
    status = "revoked" if key.is_revoked else "expired" if key.is_expired(now) else "active"
    return {
        "object": "api_key",
        "id": key.id,
        "organization": org_name,
        "name": key.name,
        "scope": key.scope,
        "prefix": key.prefix,
        "redacted_value": key.display,
        "status": status,
        "created_at": key.created_at,
        "last_used_at": key.last_used_at,
        "expires_at": key.expires_at,
        "revoked_at": key.revoked_at,
    }


def _list(data: list[dict]) -> web.Response:
    return web.json_response({"object": "list", "data": data})


# -- validation --------------------------------------------------------------------------
def _object(body: object, fields: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise bad_request(f"Unknown field '{unknown[0]}'; expected some of {list(fields)}.", param=unknown[0])
    return body


def _org_name(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string, got {value!r}.", param=param)
    if len(value) > MAX_NAME_CHARS or not ORG_NAME.fullmatch(value):
        raise bad_request(
            f"'{param}' must be 1-{MAX_NAME_CHARS} letters, digits, '.', '_' or '-', starting with a letter or digit;"
            f" got {value[:80]!r}.",
            param=param,
        )
    return value


def _org_ref(value: object, param: str) -> str:
    """The name of an existing organisation (the CLI may have made it with any name it allows)."""
    if not isinstance(value, str) or not value or len(value) > MAX_ORG_NAME_CHARS:
        raise bad_request(f"'{param}' must name an organisation, got {str(value)[:80]!r}.", param=param)
    return value


def _tier(request: web.Request, value: object) -> str:
    tiers = request.app[SETTINGS].tiers
    if not isinstance(value, str) or value not in tiers:
        raise bad_request(f"'tier' must be one of the configured tiers {sorted(tiers)}, got {value!r}.", param="tier")
    return value


def _budget(value: object) -> float | None:
    if value is None:
        return None
    # A range check, not isfinite: nan and inf fail it, and a huge JSON integer never becomes a float.
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_BUDGET_USD:
        raise bad_request(
            f"'budget_usd' must be a number of US dollars >= 0 and at most {MAX_BUDGET_USD:,.0f} (per calendar month),"
            f" or null for none; got {value!r}.",
            param="budget_usd",
        )
    return float(value)


def _limits(current: dict[str, Any], value: object) -> dict[str, Any]:
    """`current` with the changes in `value` applied; null removes every override."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(
            f"'limits' must be an object of {list(ORG_LIMITS)} (a whole number, or null to remove one).", param="limits"
        )
    if any(isinstance(v, str) for v in value.values()):
        raise bad_request("'limits' values must be whole numbers or null, not strings.", param="limits")
    try:
        return merge_org_limits(current, value)
    except ValueError as exc:
        raise bad_request(f"'limits': {exc}.", param="limits") from None


def _query_org_name(request: web.Request) -> str | None:
    name = request.query.get("organization")
    return None if name is None or name == "" else _org_ref(name, "organization")


async def _org_or_404(request: web.Request, name: str, param: str = "name") -> Org:
    org = await request.app[STATE].store.get_org(name)
    if org is None:
        raise not_found(f"No organisation named {name!r}.", param=param)
    return org


def _audit(request: web.Request, action: str, **fields: Any) -> None:
    log.info("admin_change", action=action, by_key=request[PRINCIPAL].key_id, **fields)


# -- organisations -----------------------------------------------------------------------
async def list_orgs(request: web.Request) -> web.Response:
    return _list([org_obj(o) for o in await request.app[STATE].store.list_orgs()])


async def create_org(request: web.Request) -> web.Response:
    body = _object(await read_json(request), _ORG_CREATE_FIELDS)
    name = _org_name(body.get("name"), "name")
    if name == "local":  # the keyless user's organisation: keys for it would read their conversations
        raise bad_request(
            "'local' is reserved for requests served without a key on this machine; choose another name.",
            param="name",
            code="reserved_name",
        )
    tier = _tier(request, body.get("tier"))
    budget = _budget(body.get("budget_usd"))
    limits = _limits({}, body.get("limits"))
    try:
        org = await request.app[STATE].store.create_org(name, tier, budget_usd=budget, limits=limits)
    except Conflict as exc:
        raise ApiError(409, f"{exc}.", "invalid_request_error", "organization_exists", "name") from None
    _audit(request, "organization_created", organization=name, tier=tier, budget_usd=budget, limits=limits)
    return web.json_response(org_obj(org), status=201)


async def get_org(request: web.Request) -> web.Response:
    org = await _org_or_404(request, request.match_info["name"])
    spend = await request.app[STATE].store.month_spend_usd(org.id)
    return web.json_response(org_obj(org, month_spend_usd=spend))


async def update_org(request: web.Request) -> web.Response:
    body = _object(await read_json(request), _ORG_UPDATE_FIELDS)
    if not body:
        raise bad_request(f"Send at least one of {list(_ORG_UPDATE_FIELDS)}.")
    org = await _org_or_404(request, request.match_info["name"])
    tier = _tier(request, body["tier"]) if "tier" in body else None
    budget = _budget(body["budget_usd"]) if "budget_usd" in body else UNSET
    limits = _limits(org.limits, body["limits"]) if "limits" in body else UNSET
    try:
        org = await request.app[STATE].store.update_org(org.name, tier=tier, budget_usd=budget, limits=limits)
    except NotFound:  # deleted since the read above (no route deletes one today)
        raise not_found(f"No organisation named {org.name!r}.", param="name") from None
    request.app[STATE].forget_local_org()  # in case it was the keyless `local` organisation
    _audit(request, "organization_updated", organization=org.name, changes=sorted(body))
    return web.json_response(org_obj(org))


# -- keys --------------------------------------------------------------------------------
async def _org_names(request: web.Request) -> dict[str, str]:
    return {o.id: o.name for o in await request.app[STATE].store.list_orgs()}


async def list_keys(request: web.Request) -> web.Response:
    org_name = _query_org_name(request)
    store = request.app[STATE].store
    if org_name is not None:
        await _org_or_404(request, org_name, "organization")
    names, now = await _org_names(request), time.time()
    return _list([key_obj(k, names.get(k.org_id, k.org_id), now) for k in await store.list_keys(org_name)])


async def create_key(request: web.Request) -> web.Response:
    body = _object(await read_json(request), _KEY_CREATE_FIELDS)
    org = await _org_or_404(request, _org_ref(body.get("organization"), "organization"), "organization")
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("'name' must be a string, or null.", param="name")
    if name is not None and (problem := key_name_problem(name)) is not None:
        raise bad_request(f"'name': {problem}.", param="name")
    scope = body.get("scope", INFERENCE_SCOPE)
    if scope not in KEY_SCOPES:
        raise bad_request(f"'scope' must be one of {list(KEY_SCOPES)}, got {scope!r}.", param="scope")
    days = body.get("expires_in_days")
    if days is not None and (
        isinstance(days, bool) or not isinstance(days, int | float) or not 0 < days <= MAX_EXPIRES_IN_DAYS
    ):
        raise bad_request(
            f"'expires_in_days' must be a number of days in (0, {MAX_EXPIRES_IN_DAYS:g}], or null for never;"
            f" got {days!r}.",
            param="expires_in_days",
        )
    expires_at = None if days is None else time.time() + float(days) * 86400.0
    key, secret = await request.app[STATE].store.create_key(org.name, name=name, expires_at=expires_at, scope=scope)
    _audit(request, "key_created", key=key.id, organization=org.name, scope=scope, expires_at=expires_at)
    return web.json_response({**key_obj(key, org.name, time.time()), "value": secret}, status=201)


async def revoke_key(request: web.Request) -> web.Response:
    ident = request.match_info["key"]
    store = request.app[STATE].store
    found = await store.get_key(ident)
    if found is None or not await store.revoke_key(ident):
        state = "does not exist" if found is None else "is already revoked"
        raise not_found(f"The key {ident!r} {state}; name a live key by its id (key_...) or prefix (sk-...).")
    revoked = await store.get_key(found.id) or found
    _audit(request, "key_revoked", key=revoked.id)
    names = await _org_names(request)
    return web.json_response(key_obj(revoked, names.get(revoked.org_id, revoked.org_id), time.time()))


# -- usage -------------------------------------------------------------------------------
async def usage(request: web.Request) -> web.Response:
    group_by = request.query.get("group_by", "org")
    if group_by not in GROUP_BY:
        raise bad_request(f"'group_by' must be one of {', '.join(GROUP_BY)}, got {group_by!r}.", param="group_by")
    org_name = _query_org_name(request)
    org_id = None if org_name is None else (await _org_or_404(request, org_name, "organization")).id
    start, end = time_param(request, "start"), time_param(request, "end")
    rows = await request.app[STATE].store.usage_summary(
        org_id, start=start if start is not None else month_start(), end=end, group_by=group_by
    )
    return web.json_response(usage_body(group_by, rows))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/admin/organizations", list_orgs)
    app.router.add_post("/v1/admin/organizations", create_org)
    app.router.add_get("/v1/admin/organizations/{name}", get_org)
    app.router.add_patch("/v1/admin/organizations/{name}", update_org)
    app.router.add_get("/v1/admin/keys", list_keys)
    app.router.add_post("/v1/admin/keys", create_key)
    app.router.add_delete("/v1/admin/keys/{key}", revoke_key)
    app.router.add_get("/v1/admin/usage", usage)
