"""The HTTP hook an external broker asks about every client (``broker_hook_token`` set; mode ``hook`` of
``server.services.broker_access``): RabbitMQ's ``rabbitmq_auth_backend_http`` with ``auth_http.http_method =
post``, whose four questions arrive form-encoded and are answered ``allow`` or ``deny`` in plain text.

The token in the path is the only credential the broker can send; a wrong one is answered 404, as a route that
does not exist (nothing to probe). Passwords travel in the body, never in a URL that an access log keeps. A
question that cannot be parsed is answered ``deny``: the broker refuses, the client gets a clear CONNACK or
disconnect from its broker, the server logs nothing but the refusal."""

from __future__ import annotations

import hmac
from typing import Annotated, Literal
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse

from ..errors import NotFound
from ..services.broker_access import BrokerAccess

__all__ = ["router"]

router = APIRouter(prefix="/broker/hook", tags=["broker"], include_in_schema=False)

_FIELDS = 16


async def _access(request: Request, token: str) -> BrokerAccess:
    st = request.app.state.pfl
    want = st.settings.broker_hook_token
    if want is None or not hmac.compare_digest(token.encode(), want.get_secret_value().encode()):
        raise NotFound("Not Found")
    access: BrokerAccess = st.coordinator.broker_access
    return access


Access = Annotated[BrokerAccess, Depends(_access)]


async def _form(request: Request) -> dict[str, str]:
    body = await request.body()  # bounded by server.limits (4 KiB) before it gets here
    try:
        parsed = parse_qs(body.decode(), keep_blank_values=True, strict_parsing=False, max_num_fields=_FIELDS)
    except (UnicodeDecodeError, ValueError):
        return {}
    return {k: v[0] for k, v in parsed.items() if len(v) == 1}


def _answer(ok: bool) -> PlainTextResponse:
    return PlainTextResponse("allow" if ok else "deny")


@router.post("/{token}/{question}")
async def hook(request: Request, access: Access,
               question: Literal["user", "vhost", "resource", "topic"]) -> PlainTextResponse:
    form = await _form(request)
    user = form.get("username", "")
    if not user:
        return _answer(False)
    vhost = request.app.state.pfl.settings.broker_hook_vhost
    if question == "user":
        ok = await run_in_threadpool(access.hook_user, user, form.get("password", ""), form.get("client_id"))
    elif question == "vhost":
        ok = await run_in_threadpool(access.hook_vhost, user, form.get("vhost", ""), vhost)
    elif question == "resource":
        ok = form.get("vhost") == vhost and await run_in_threadpool(
            access.hook_resource, user, form.get("resource", ""), form.get("name", ""), form.get("permission", ""))
    else:
        ok = form.get("vhost") == vhost and await run_in_threadpool(
            access.hook_topic, user, form.get("name", ""), form.get("permission", ""), form.get("routing_key", ""))
    return _answer(ok)
