"""The embedded broker's MQTT 3.1.1 logic in asyncio: sessions, subscriptions, retained messages, wills, client-id
takeover, keepalive, and identities with topic access rules. ``server.broker`` runs it in its own thread.

What it implements (what pfl-edge's server and devices use): QoS 0 and 1, and QoS 2 inbound (a QoS 2 publish or will
is routed once, on arrival, and answered PUBREC; its PUBREL gets PUBCOMP; a resent duplicate of a packet id still
awaiting its PUBREL is not routed again) with delivery downgraded to QoS 1 (QoS 2 subscriptions are granted QoS 1,
as MQTT 3.1.1 section 3.8.4 allows: subscribers see each message at least once); retained messages delivered by
topic filter only, last wills, persistent sessions (clean_session False) whose QoS 1 messages wait while the client
is away and are sent again on reconnect, client-id takeover (a second connection with a client id closes the first,
without its will, and gets the session), keepalive (a connection silent for 1.5 x its keepalive is closed and its
will published; keepalive 0 gets ``idle_s``), and bounded memory (connections: ``server.broker_door``; packet size,
CONNECT's a few KB; per-session queue; write buffer: a client that stops reading is disconnected, except the
server's own link, which loses QoS 0 messages instead; CONNECT within ``connect_timeout_s``). A client with write
rules (a device) publishes at most ``device_payload`` bytes a message, ``device_rate`` a second after a burst of
``device_burst``; the rest are acknowledged and dropped. Log lines a client can cause are counted in ``noted`` and
pass one :class:`~.broker_wire.LogGate`.

Access: ``authenticate(client_id, username, password)`` (called in a worker thread: it may query a database)
answers an :class:`Identity` or None (refused). An identity reads (subscribes to, receives, gets retained) only
its ``read`` topics and publishes (its will included) only to its ``write`` topics; ``None`` means every topic.
A refused subscription gets SUBACK 0x80; a refused publish is acknowledged and dropped, as Mosquitto does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import broker_wire as w
from .broker_door import Door
from .broker_wire import ANYONE, Authenticator, Identity

__all__ = ["ANYONE", "MAX_CONNECT", "MAX_DEVICE_PAYLOAD", "MAX_PACKET", "Authenticator", "BrokerCore", "Identity"]

log = logging.getLogger("server.broker")


@dataclass(eq=False)
class _Session:
    client_id: str
    identity: Identity
    clean: bool
    subs: dict[str, int] = field(default_factory=dict)
    queue: deque[w.Publish] = field(default_factory=deque)  # QoS 1 messages not yet sent
    inflight: dict[int, w.Publish] = field(default_factory=dict)  # sent, not yet acknowledged
    released: set[int] = field(default_factory=set)  # QoS 2 packet ids received and routed, awaiting PUBREL
    conn: _Conn | None = None
    last_pid: int = 0

    def new_pid(self) -> int:
        for _ in range(65535):
            self.last_pid = self.last_pid % 65535 + 1
            if self.last_pid not in self.inflight:
                return self.last_pid
        raise w.WireError("no free packet identifier")


@dataclass(eq=False)
class _Conn:
    writer: asyncio.StreamWriter
    session: _Session
    will: w.Publish | None
    bucket: w.Bucket  # its publishes (a client with write rules)
    dead: bool = False
    refused: Counter[str] = field(default_factory=Counter)  # what it was refused or lost, by kind


# The largest packet a client may send (its remaining length): refused before it is read. pfl-edge's own messages
# are far below it (the largest, a Task with MAX_NEIGHBOURS neighbours, is ~180 KB: tests/server); models travel
# over HTTP, never MQTT. docs/protocol.md states it.
MAX_PACKET = 256 * 1024
# The first packet (CONNECT: a client id, a user name, a password, a will of ~100 bytes) is bounded far lower
# before authentication: 1,500 half-sent CONNECTs of 256 KiB held over 400 MB of the broker's memory.
MAX_CONNECT = 4 * 1024
# What a client with write rules (a device: its status, ~100 bytes of JSON) may publish; server.mqtt drops a
# longer status too, whatever the broker: 256 KiB garbage statuses once flooded the server's own link.
MAX_DEVICE_PAYLOAD = 1024


class BrokerCore:
    def __init__(self, authenticate: Authenticator | None = None, *, max_packet: int = MAX_PACKET,
                 max_queue: int = 1000, max_inflight: int = 100, max_buffer: int = 4 << 20,
                 connect_timeout_s: float = 10.0, idle_s: float = 600.0, door: Door | None = None,
                 max_connect: int = MAX_CONNECT, device_payload: int = MAX_DEVICE_PAYLOAD,
                 device_rate: float = 1.0, device_burst: int = 10, clock: Callable[[], float] = time.monotonic) -> None:
        self.authenticate, self.door = authenticate, door if door is not None else Door()  # who may connect
        self.max_connect, self.device_payload, self.device_rate, self.device_burst, self.clock = \
            max_connect, device_payload, device_rate, device_burst, clock
        self.log_gate, self.noted = w.LogGate(clock=clock), Counter[str]()  # noted: refusals and losses by kind
        self.max_packet, self.max_queue, self.max_inflight, self.max_buffer, self.connect_timeout_s, self.idle_s = \
            max_packet, max_queue, max_inflight, max_buffer, connect_timeout_s, idle_s
        self.sessions: dict[str, _Session] = {}
        self.retained: dict[str, w.Publish] = {}
        self._subs: dict[str, dict[str, int]] = {}  # filter -> {client id: QoS}
        self._wild: set[str] = set()  # the filters in _subs with a wildcard

    # ------------------------------------------------------------------------------------------ connections
    def _note(self, kind: str, level: int, msg: str, *args: object, conn: _Conn | None = None,
              exc_info: bool = False) -> None:
        """A refusal or a loss a client caused: counted (broker-wide, and per connection), logged through the gate."""
        self.noted[kind] += 1
        if conn is not None:
            conn.refused[kind] += 1
        self.log_gate(log, level, kind, msg, *args, exc_info=exc_info)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection, from CONNECT to its end."""
        conn: _Conn | None = None
        host = w.peer_host(writer)
        guest = self.door.admit(host, writer.transport, lambda: self._reset(host, writer))
        if isinstance(guest, str):
            self._note("accept", logging.WARNING, "MQTT connection from %s refused: %s", w.shown(host), guest)
            writer.transport.abort()
            return
        try:
            kind, _flags, body = await asyncio.wait_for(w.read_packet(reader, self.max_connect),
                                                        self.connect_timeout_s)
            if not self.door.whole(guest):  # reset for a newcomer while its CONNECT came in: no answer
                return
            if kind != w.CONNECT:
                raise w.WireError("the first packet is not CONNECT")
            c = w.parse_connect(body)
            conn = await self._connect(c, writer)
            if conn is None:
                return
            self.door.settle(guest)  # logged in: no longer counted against its address
            idle = c.keepalive * 1.5 if c.keepalive else self.idle_s
            while not conn.dead:
                kind, flags, body = await asyncio.wait_for(w.read_packet(reader, self.max_packet), idle)
                if kind == w.DISCONNECT:
                    conn.will = None
                    break
                if not conn.dead:
                    self._packet(conn, kind, flags, body)
        except TimeoutError:
            self._note("silent", logging.INFO, "MQTT client %s silent past its keepalive: closed",
                       w.shown(conn.session.client_id if conn else "?"))
        except (w.WireError, UnicodeError) as e:
            self._note("malformed", logging.WARNING, "MQTT connection from %s closed: %s", w.shown(host), e)
        except (asyncio.IncompleteReadError, OSError, asyncio.CancelledError):  # gone, or reset; or the broker
            pass  # stops: end quietly (asyncio's stream callback would log a cancellation)
        finally:
            self.door.leave(guest)
            if conn is not None:
                self._drop(conn, will=True)
                if conn.refused.total() > 1:  # the gate may have held its lines back: one line of them all
                    self._note("summary", logging.WARNING, "MQTT client %s refused or lost in its connection: %s",
                               w.shown(conn.session.client_id), dict(conn.refused))
            writer.close()

    def _reset(self, host: str, writer: asyncio.StreamWriter) -> None:  # the door's, for a newcomer
        self._note("evicted", logging.INFO, "MQTT connection from %s without a CONNECT reset", w.shown(host))
        writer.transport.abort()

    async def _connect(self, c: w.Connect, writer: asyncio.StreamWriter) -> _Conn | None:
        """The client's connection once CONNACK accepted it; None after a refusal (CONNACK sent)."""
        if c.level != 4:
            writer.write(w.connack(False, 1))  # unacceptable protocol version
            return None
        client_id = c.client_id
        if not client_id:
            if not c.clean:
                writer.write(w.connack(False, 2))
                return None
            client_id = "auto-" + secrets.token_hex(8)
        ident = ANYONE
        if self.authenticate is not None:
            try:
                got = await asyncio.get_running_loop().run_in_executor(None, self.authenticate, client_id,
                                                                         c.username, c.password)
            except Exception:  # e.g. the database is away: "server unavailable", the client retries
                self._note("auth-error", logging.ERROR, "MQTT client %s: authentication failed", w.shown(client_id),
                           exc_info=True)
                writer.write(w.connack(False, 3))
                return None
            if got is None:
                self._note("connect", logging.WARNING, "MQTT client %s (user %s) refused: unknown user or wrong "
                           "password", w.shown(client_id), w.shown(c.username))
                writer.write(w.connack(False, 4 if c.username else 5))
                return None
            ident = got
        if ident.client_id is not None and ident.client_id != client_id:
            self._note("connect", logging.WARNING, "MQTT user %s refused: client id %s is not its own",
                       w.shown(ident.username), w.shown(client_id))
            writer.write(w.connack(False, 2))
            return None
        if c.will is not None and not (ident.may_write(c.will.topic) and self._fits(ident, c.will)):
            self._note("connect", logging.WARNING, "MQTT user %s refused: may not leave a will of %d bytes on %s",
                       w.shown(ident.username), len(c.will.payload), w.shown(c.will.topic))
            writer.write(w.connack(False, 5))
            return None
        return self._attach(client_id, ident, c, writer)

    def _fits(self, ident: Identity, p: w.Publish) -> bool:  # a device's message, its will included
        return ident.write is None or len(p.payload) <= self.device_payload

    def _attach(self, client_id: str, ident: Identity, c: w.Connect, writer: asyncio.StreamWriter) -> _Conn:
        old = self.sessions.get(client_id)
        if old is not None and old.conn is not None:
            self._note("takeover", logging.INFO, "MQTT client %s connected again: the old connection is closed "
                       "(takeover)", w.shown(client_id))
            self._drop(old.conn, will=False)
        if old is not None and (c.clean or old.clean or old.identity.username != ident.username):
            self._forget(old)
            old = None
        sess = old if old is not None else _Session(client_id, ident, c.clean)
        sess.identity = ident
        self.sessions[client_id] = sess
        conn = _Conn(writer, sess, c.will, w.Bucket(self.device_rate, self.device_burst, self.clock))
        sess.conn = conn
        self._send(conn, w.connack(old is not None, 0))
        for p in list(sess.inflight.values()):
            self._send(conn, w.publish(replace(p, dup=True)))
        self._flush_queue(sess)
        return conn

    def _drop(self, conn: _Conn, *, will: bool) -> None:
        """The end of a connection: its session stays (persistent) or goes (clean); its will is published."""
        if conn.dead:
            return
        conn.dead = True
        with contextlib.suppress(Exception):
            conn.writer.transport.abort()
        sess = conn.session
        if sess.conn is conn:
            sess.conn = None
            if sess.clean:
                self._forget(sess)
        if will and conn.will is not None:
            self._route(conn.will)

    def _forget(self, sess: _Session) -> None:
        if self.sessions.get(sess.client_id) is sess:
            del self.sessions[sess.client_id]
        for f in list(sess.subs):
            self._unsubscribe(sess, f)

    def _full(self, conn: _Conn) -> bool:
        return conn.writer.transport.get_write_buffer_size() > self.max_buffer

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.dead:
            return
        conn.writer.write(data)
        # the server's link stays: what it is sent is bounded (QoS 1 by max_inflight, QoS 0 dropped in _deliver)
        if self._full(conn) and not conn.session.identity.own:
            self._note("slow", logging.WARNING, "MQTT client %s does not read: disconnected",
                       w.shown(conn.session.client_id))
            self._drop(conn, will=True)

    # ---------------------------------------------------------------------------------------------- packets
    def _packet(self, conn: _Conn, kind: int, flags: int, body: bytes) -> None:
        sess = conn.session
        if kind == w.PUBLISH:
            self._publish(conn, w.parse_publish(flags, body))
        elif kind == w.PUBACK:
            if len(body) != 2:
                raise w.WireError("malformed PUBACK")
            sess.inflight.pop(int.from_bytes(body, "big"), None)
            self._flush_queue(sess)
        elif kind == w.PUBREL:
            if flags != 2 or len(body) != 2:
                raise w.WireError("malformed PUBREL")
            pid = int.from_bytes(body, "big")
            sess.released.discard(pid)
            self._send(conn, w.pubcomp(pid))
        elif kind == w.SUBSCRIBE:
            if flags != 2:
                raise w.WireError("malformed SUBSCRIBE")
            self._subscribe(conn, *w.parse_subscribe(body))
        elif kind == w.UNSUBSCRIBE:
            if flags != 2:
                raise w.WireError("malformed UNSUBSCRIBE")
            pid, filters = w.parse_unsubscribe(body)
            for f in filters:
                self._unsubscribe(sess, f)
            self._send(conn, w.unsuback(pid))
        elif kind == w.PINGREQ:
            self._send(conn, w.PINGRESP_BYTES)
        else:
            raise w.WireError(f"unexpected packet type {kind}")

    def _publish(self, conn: _Conn, p: w.Publish) -> None:
        sess = conn.session
        if p.qos == 2 and p.pid in sess.released:  # a resend before its PUBREL: routed already (method B)
            self._send(conn, w.pubrec(p.pid))
            return
        ident = sess.identity
        if not ident.may_write(p.topic):
            self._note("publish", logging.WARNING, "MQTT user %s may not publish to %s: dropped",
                       w.shown(ident.username), w.shown(p.topic), conn=conn)
        elif not self._fits(ident, p):
            self._note("oversize", logging.WARNING, "MQTT user %s published %d bytes to %s, over %d: dropped",
                       w.shown(ident.username), len(p.payload), w.shown(p.topic), self.device_payload, conn=conn)
        elif ident.write is not None and not conn.bucket.take():
            self._note("rate", logging.WARNING, "MQTT user %s publishes faster than %g a second: dropped",
                       w.shown(ident.username), self.device_rate, conn=conn)
        else:
            self._route(p)
        if p.qos == 1:
            self._send(conn, w.puback(p.pid))
        elif p.qos == 2:
            sess.released.add(p.pid)  # at most 65,535 ids: bounded by the packet id's width
            self._send(conn, w.pubrec(p.pid))

    def _subscribe(self, conn: _Conn, pid: int, subs: list[tuple[str, int]]) -> None:
        sess, codes, granted = conn.session, [], []
        for f, qos in subs:
            if not w.valid_filter(f) or not sess.identity.may_subscribe(f):
                self._note("subscribe", logging.WARNING, "MQTT user %s may not subscribe to %s: refused",
                           w.shown(sess.identity.username), w.shown(f), conn=conn)
                codes.append(0x80)
                continue
            qos = min(qos, 1)
            sess.subs[f] = qos
            self._subs.setdefault(f, {})[sess.client_id] = qos
            if "+" in f or "#" in f:
                self._wild.add(f)
            codes.append(qos)
            granted.append((f, qos))
        self._send(conn, w.suback(pid, codes))
        for f, qos in granted:  # retained messages by filter, and only those it may read
            topics = self.retained if f in self._wild else ([f] if f in self.retained else [])
            for topic in list(topics):
                r = self.retained[topic]
                if w.matches(f, topic) and sess.identity.may_read(topic):
                    self._deliver(sess, replace(r, qos=min(qos, r.qos), retain=True, dup=False, pid=0))

    def _unsubscribe(self, sess: _Session, f: str) -> None:
        sess.subs.pop(f, None)
        subs = self._subs.get(f)
        if subs is not None:
            subs.pop(sess.client_id, None)
            if not subs:
                del self._subs[f]
                self._wild.discard(f)

    # ---------------------------------------------------------------------------------------------- routing
    def _route(self, p: w.Publish) -> None:
        """A message someone may publish: kept if retained, delivered to every session whose filter matches
        and that may read it."""
        if p.retain:
            if p.payload:
                self.retained[p.topic] = replace(p, dup=False, pid=0)
            else:
                self.retained.pop(p.topic, None)
        targets: dict[str, int] = {}
        for f in (p.topic, *self._wild):
            for cid, qos in self._subs.get(f, {}).items():
                if f == p.topic or w.matches(f, p.topic):
                    targets[cid] = max(targets.get(cid, 0), qos)
        for cid, qos in targets.items():
            sess = self.sessions.get(cid)
            if sess is not None and sess.identity.may_read(p.topic):
                self._deliver(sess, w.Publish(p.topic, p.payload, qos=min(qos, p.qos)))

    def _deliver(self, sess: _Session, p: w.Publish) -> None:
        if p.qos == 0:
            if sess.conn is not None and sess.identity.own and self._full(sess.conn):  # lost, not disconnected
                self._note("own-slow", logging.WARNING, "the server's MQTT link reads slowly: a QoS 0 message lost")
            elif sess.conn is not None:
                self._send(sess.conn, w.publish(p))
            return
        sess.queue.append(p)
        if len(sess.queue) > self.max_queue:
            sess.queue.popleft()
            self._note("queue", logging.WARNING, "MQTT client %s has %d messages waiting: the oldest dropped",
                       w.shown(sess.client_id), self.max_queue, conn=sess.conn)
        self._flush_queue(sess)

    def _flush_queue(self, sess: _Session) -> None:
        while sess.conn is not None and sess.queue and len(sess.inflight) < self.max_inflight:
            p = replace(sess.queue.popleft(), pid=sess.new_pid())
            sess.inflight[p.pid] = p
            self._send(sess.conn, w.publish(p))

    # ---------------------------------------------------------------------------------------------- control
    def publish(self, p: w.Publish) -> None:
        """A message from inside this process (benchmarks, tests), with every right: kept and routed."""
        self._route(p)

    def kick(self, username: str) -> int:
        """Close every connection of ``username`` (no will) and forget its sessions; how many sessions."""
        gone = [s for s in self.sessions.values() if s.identity.username == username]
        for sess in gone:
            if sess.conn is not None:
                self._drop(sess.conn, will=False)
            self._forget(sess)
        return len(gone)

    def close_all(self) -> None:
        for sess in list(self.sessions.values()):
            if sess.conn is not None:
                self._drop(sess.conn, will=False)
