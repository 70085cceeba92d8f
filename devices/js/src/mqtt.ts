/**
 * The control plane (docs/protocol.md, "Planes", "MQTT topics", "What a device checks on every MQTT message",
 * "A minimal device" step 2): the device logs in with its own credentials from the enrolment (username = its id,
 * client id the enrolment gave, a persistent session), leaves an `offline` will and publishes `online` on its status
 * topic (QoS 1, retained), subscribes (QoS 1) to `pfl/<fed>/round` and its own task topic, and treats every
 * message as a doorbell only: a message that passes the checks (exact topic, size, schema, federation, not stale)
 * rings `onBell`, and the device then asks the server for its task over HTTP. A (re)connect rings too (a retained
 * message may never come). Reconnects back off from 1 s to 30 s; after 15 s without the broker the device asks the
 * server where the broker is now (`GET /v1/devices/me/broker`) and follows it if it moved.
 *
 * Token brokers (docs/protocol.md, "MQTT credentials"; docs/operations.md, "Clustered brokers"): where the MQTT
 * password is a JWT, a CONNACK refusal as not authorised (3.1.1 return code 4 or 5) asks the server at once for a
 * fresh one (`BrokerInfo.mqtt_password`) and reconnects with it; and a fresh one is fetched at nine tenths of the
 * token's life, for the next connect (the broker closes a connection whose token expired at its next publish or
 * subscription, and mqtt.js reconnects with `client.options.password`). A plain password: none of this.
 *
 * The MQTT client library is passed in (`connect`, mqtt.js's), so that a phone can use its WebSocket transport.
 * Platform-neutral.
 */
import type { IClientOptions, MqttClient } from 'mqtt';

import { type BrokerInfo, type RoundAnnouncement, type Task, parseAnnouncement, parseTask, topics } from './messages.js';
import { decodeUtf8 } from './utf8.js';

export type MqttConnect = (url: string, opts: IClientOptions) => MqttClient;

export const MAX_MESSAGE_BYTES = 1 << 20;

/** The longest a JS timer may wait (a longer delay fires at once). */
const MAX_TIMER_MS = 2 ** 31 - 1;

/** The clock and timers the token refresh uses (a test passes fake ones). */
export interface Clock {
  /** milliseconds since the epoch */
  now(): number;
  setTimeout(fn: () => void, ms: number): unknown;
  clearTimeout(handle: unknown): void;
}

const realClock: Clock = {
  now: () => Date.now(),
  setTimeout: (fn, ms) => setTimeout(fn, ms),
  clearTimeout: (h) => clearTimeout(h as ReturnType<typeof setTimeout>),
};

const B64URL = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_';

/** base64url (padding optional) to bytes; null if it is not base64url. By hand: no `Buffer` (a Node API) here. */
export function decodeBase64Url(s: string): Uint8Array | null {
  const t = s.replace(/=+$/, '');
  if (t.length % 4 === 1) return null;
  const out = new Uint8Array(Math.floor((t.length * 3) / 4));
  let acc = 0;
  let bits = 0;
  let n = 0;
  for (let i = 0; i < t.length; i++) {
    const v = B64URL.indexOf(t[i]!);
    if (v < 0) return null;
    acc = ((acc << 6) | v) & 0xffffff;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out[n++] = (acc >> bits) & 0xff;
    }
  }
  return out.subarray(0, n);
}

/**
 * The `exp` (seconds since the epoch) of a JWT password (three base64url parts), read WITHOUT verifying its
 * signature: the device holds no key and needs none, it only plans when to ask for a fresh token; the broker
 * verifies. null for a plain password (or a token without a numeric `exp`).
 */
export function tokenExpiry(password: string): number | null {
  const parts = password.split('.');
  if (parts.length !== 3) return null;
  const bytes = decodeBase64Url(parts[1]!);
  if (bytes === null) return null;
  let payload: unknown;
  try {
    payload = JSON.parse(decodeUtf8(bytes));
  } catch {
    return null;
  }
  if (typeof payload !== 'object' || payload === null || Array.isArray(payload)) return null;
  const exp = (payload as Record<string, unknown>)['exp'];
  return typeof exp === 'number' && Number.isFinite(exp) ? exp : null;
}

/**
 * Did the broker refuse the CONNECT as not authorised? MQTT 3.1.1 CONNACK 4 (bad user name or password) or 5 (not
 * authorised): mqtt.js emits `error` with that return code as a numeric `code` (134, 135 in MQTT 5).
 */
export function notAuthorised(err: unknown): boolean {
  if (typeof err !== 'object' || err === null) return false;
  const code = (err as { code?: unknown }).code;
  return typeof code === 'number' && [4, 5, 134, 135].includes(code);
}

/** A refusal as not authorised while the password is a token: ask the server for a fresh one at once. */
export const wantsFreshToken = (err: unknown, password: string): boolean => notAuthorised(err) && tokenExpiry(password) !== null;

/** When to ask for a fresh token (ms from now): at nine tenths of its remaining life, at least 1 s; null: never. */
export function refreshDelayMs(password: string, nowMs: number): number | null {
  const exp = tokenExpiry(password);
  if (exp === null) return null;
  return Math.min(MAX_TIMER_MS, Math.max(1000, Math.round((exp * 1000 - nowMs) * 0.9)));
}

export interface BellOptions {
  federation: string;
  deviceId: string;
  /** its MQTT client id (the enrolment's `mqtt_client_id`, else `pfl-<device id>`) */
  clientId: string;
  brokerUrl: string;
  username: string;
  password: string;
  connect: MqttConnect;
  /** a message (or a connect) worth asking the server about; `hint`: the broker's task, if it sent one */
  onBell: (hint: Task | null, announcement: RoundAnnouncement | null) => void;
  /** is this task stale (an older round, or one whose update the server already accepted)? */
  isStale: (task: Task) => boolean;
  /** where the broker is now, and a token broker's fresh MQTT password, as the server says (`GET /v1/devices/me/broker`) */
  brokerNow?: () => Promise<BrokerInfo>;
  /** the clock and timers of the token refresh (default: the real ones) */
  clock?: Clock;
  log?: (level: 'info' | 'warn' | 'error', msg: string) => void;
  /** extra client options (TLS: `ca`) */
  extra?: Partial<IClientOptions>;
}

export class Bell {
  private client: MqttClient | null = null;
  private url: string;
  private lastUp = Date.now();
  private connected = false;
  private closed = false;
  private watchdog: ReturnType<typeof setInterval> | null = null;
  private asking = false;
  private password: string;
  private refreshing = false;
  private refusals = 0; // refusals since the last connect
  private refreshTimer: unknown = null;
  private retryTimer: unknown = null;
  private readonly clock: Clock;
  readonly topics: ReturnType<typeof topics>;

  constructor(readonly o: BellOptions) {
    this.url = o.brokerUrl;
    this.password = o.password;
    this.clock = o.clock ?? realClock;
    this.topics = topics(o.federation, o.deviceId);
  }

  /** The MQTT password the next connect uses (a token broker's latest token). */
  get currentPassword(): string {
    return this.password;
  }

  private log(level: 'info' | 'warn' | 'error', msg: string): void {
    this.o.log?.(level, msg);
  }

  private status(state: 'online' | 'offline'): string {
    return JSON.stringify({ device_id: this.o.deviceId, state });
  }

  start(): void {
    this.closed = false;
    if (this.o.username) this.scheduleRefresh(this.password);
    this.open();
    this.watchdog = setInterval(() => void this.followBroker(), 5000);
  }

  private open(): void {
    const o = this.o;
    const client = o.connect(this.url, {
      clientId: o.clientId,
      username: o.username,
      password: this.password,
      clean: false,
      protocolVersion: 4,
      keepalive: 60,
      reconnectPeriod: 1000,
      // a refused plain password is tried again with the back-off, as the Python device does (mqtt.js would stop);
      // a refused token is renewed and retried by refused() instead
      reconnectOnConnackError: tokenExpiry(this.password) === null,
      connectTimeout: 15_000,
      resubscribe: true,
      will: { topic: this.topics.status, payload: this.status('offline'), qos: 1, retain: true },
      ...o.extra,
    });
    this.client = client;
    client.on('connect', () => {
      if (client !== this.client) return;
      this.connected = true;
      this.refusals = 0;
      this.lastUp = Date.now();
      client.options.reconnectPeriod = 1000;
      this.log('info', `connected to the broker ${this.url}`);
      client.publish(this.topics.status, this.status('online'), { qos: 1, retain: true }, (err) => {
        if (err) this.log('warn', `publishing online: ${err.message}`);
      });
      client.subscribe({ [this.topics.round]: { qos: 1 }, [this.topics.task]: { qos: 1 } }, (err, granted) => {
        if (err) {
          this.log('error', `subscribing: ${err.message}`);
          return;
        }
        for (const g of granted ?? []) if (g.qos === 128) this.log('error', `the broker refused the subscription to ${g.topic}`);
      });
      o.onBell(null, null);
    });
    client.on('message', (topic, payload) => this.message(topic, payload));
    client.on('close', () => {
      if (client !== this.client) return;
      if (this.connected) this.lastUp = Date.now();
      this.connected = false;
      const next = Math.min((client.options.reconnectPeriod ?? 1000) * 2, 30_000);
      client.options.reconnectPeriod = next;
    });
    client.on('error', (e) => {
      this.log('warn', `broker: ${e.message}`);
      if (client === this.client && wantsFreshToken(e, this.password)) void this.refused(client);
    });
  }

  /**
   * The broker refused the token (expired, or an old one after a restart): mqtt.js does not retry after a CONNACK
   * refusal, so ask the server for a fresh token and reconnect with it: at once after the first refusal, after the
   * back-off (1 s doubling to 30 s) if the broker refuses a fresh token too or none came (the server is away, or
   * refuses a revoked device). The server's answer also says where the broker is now: a moved broker is followed.
   */
  private async refused(client: MqttClient): Promise<void> {
    this.refusals++;
    if (this.closed || this.refreshing || !this.o.brokerNow) return;
    this.refreshing = true;
    const before = this.password;
    let info: BrokerInfo | null = null;
    try {
      info = await this.askServer();
    } catch (e) {
      this.log('warn', `could not fetch a fresh MQTT token from the server: ${(e as Error).message}`);
    } finally {
      this.refreshing = false;
    }
    if (this.closed || client !== this.client) return;
    if (info !== null && info.broker_url !== this.url) {
      this.move(info.broker_url);
      return;
    }
    const fresh = this.password !== before;
    if (fresh) this.log('info', 'reconnecting with a fresh MQTT token');
    this.clearRetry();
    this.retryTimer = this.clock.setTimeout(() => {
      this.retryTimer = null;
      if (this.closed || client !== this.client || client.connected) return;
      // keep the session's stores: QoS 1 messages not yet acknowledged are sent again
      client.reconnect({ incomingStore: client.incomingStore, outgoingStore: client.outgoingStore });
    }, fresh && this.refusals === 1 ? 0 : (client.options.reconnectPeriod ?? 1000));
  }

  /** `GET /v1/devices/me/broker`; a fresh MQTT password in the answer is used from the next connect. */
  private async askServer(): Promise<BrokerInfo> {
    const info = await this.o.brokerNow!();
    this.freshPassword(info.mqtt_password ?? null);
    return info;
  }

  private freshPassword(password: string | null): void {
    if (!password || !this.o.username || this.closed) return;
    this.password = password;
    if (this.client !== null) this.client.options.password = password;
    this.scheduleRefresh(password);
  }

  /** Ask for a fresh token at nine tenths of this one's life (nothing for a plain password). */
  private scheduleRefresh(password: string): void {
    const delay = refreshDelayMs(password, this.clock.now());
    if (delay === null || !this.o.brokerNow) return;
    if (this.refreshTimer !== null) this.clock.clearTimeout(this.refreshTimer);
    this.refreshTimer = this.clock.setTimeout(() => {
      this.refreshTimer = null;
      if (this.closed) return;
      this.askServer().catch((e: unknown) => {
        // a refusal at the next connect asks again
        this.log('warn', `could not fetch a fresh MQTT token from the server: ${(e as Error).message}`);
      });
    }, delay);
  }

  private clearRetry(): void {
    if (this.retryTimer !== null) this.clock.clearTimeout(this.retryTimer);
    this.retryTimer = null;
  }

  private move(url: string): void {
    this.log('warn', `the broker moved: ${this.url} -> ${url}`);
    const old = this.client;
    this.url = url;
    this.clearRetry();
    old?.end(true);
    this.open();
  }

  /** 15 s without the broker: ask the server where it is now, and follow it if it moved. */
  private async followBroker(): Promise<void> {
    if (this.closed || this.connected || this.asking || !this.o.brokerNow || Date.now() - this.lastUp < 15_000) return;
    this.asking = true;
    try {
      const url = (await this.askServer()).broker_url;
      this.lastUp = Date.now();
      if (url !== this.url && !this.closed) this.move(url);
    } catch (e) {
      this.log('warn', `asking where the broker is: ${(e as Error).message}`);
    } finally {
      this.asking = false;
    }
  }

  /** The checks of docs/protocol.md on one message; a message that passes rings the bell. */
  message(topic: string, payload: Uint8Array): void {
    const t = this.topics;
    if (topic !== t.round && topic !== t.task) return; // string equality, never a wildcard match
    if (payload.length === 0) return; // a cleared retained message
    if (payload.length > MAX_MESSAGE_BYTES) {
      this.log('warn', `dropped a message of ${payload.length} bytes on ${topic}`);
      return;
    }
    let body: unknown;
    try {
      body = JSON.parse(decodeUtf8(payload));
    } catch {
      this.log('warn', `dropped a message on ${topic} that is not JSON`);
      return;
    }
    try {
      if (topic === t.task) {
        const task = parseTask(body);
        if (task.federation !== this.o.federation || this.o.isStale(task)) return;
        this.o.onBell(task, null);
      } else {
        const ann = parseAnnouncement(body);
        if (ann.federation !== this.o.federation) return;
        this.o.onBell(null, ann);
      }
    } catch (e) {
      this.log('warn', `dropped a message on ${topic}: ${(e as Error).message}`);
    }
  }

  /** Publishes `offline` (retained) and disconnects. */
  async close(): Promise<void> {
    this.closed = true;
    if (this.watchdog !== null) clearInterval(this.watchdog);
    if (this.refreshTimer !== null) this.clock.clearTimeout(this.refreshTimer);
    this.refreshTimer = null;
    this.clearRetry();
    const c = this.client;
    if (c === null) return;
    if (this.connected) {
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, 3000);
        c.publish(this.topics.status, this.status('offline'), { qos: 1, retain: true }, () => {
          clearTimeout(timer);
          resolve();
        });
      });
    }
    await new Promise<void>((resolve) => c.end(false, {}, () => resolve()));
  }
}
