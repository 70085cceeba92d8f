/**
 * The control plane (docs/protocol.md, "Planes", "MQTT topics", "What a device checks on every MQTT message",
 * "A minimal device" step 2): the device logs in with its own credentials from the enrolment (username = its id,
 * client id `pfl-<id>`, a persistent session), leaves an `offline` will and publishes `online` on its status
 * topic (QoS 1, retained), subscribes (QoS 1) to `pfl/<fed>/round` and its own task topic, and treats every
 * message as a doorbell only: a message that passes the checks (exact topic, size, schema, federation, not stale)
 * rings `onBell`, and the device then asks the server for its task over HTTP. A (re)connect rings too (a retained
 * message may never come). Reconnects back off from 1 s to 30 s; after 15 s without the broker the device asks the
 * server where the broker is now (`GET /v1/devices/me/broker`) and follows it if it moved.
 *
 * The MQTT client library is passed in (`connect`, mqtt.js's), so that a phone can use its WebSocket transport.
 * Platform-neutral.
 */
import type { IClientOptions, MqttClient } from 'mqtt';

import { type RoundAnnouncement, type Task, parseAnnouncement, parseTask, topics } from './messages.js';
import { decodeUtf8 } from './utf8.js';

export type MqttConnect = (url: string, opts: IClientOptions) => MqttClient;

export const MAX_MESSAGE_BYTES = 1 << 20;

export interface BellOptions {
  federation: string;
  deviceId: string;
  brokerUrl: string;
  username: string;
  password: string;
  connect: MqttConnect;
  /** a message (or a connect) worth asking the server about; `hint`: the broker's task, if it sent one */
  onBell: (hint: Task | null, announcement: RoundAnnouncement | null) => void;
  /** is this task stale (an older round, or one whose update the server already accepted)? */
  isStale: (task: Task) => boolean;
  /** where the broker is now, as the server says (`GET /v1/devices/me/broker`) */
  brokerNow?: () => Promise<string>;
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
  readonly topics: ReturnType<typeof topics>;

  constructor(readonly o: BellOptions) {
    this.url = o.brokerUrl;
    this.topics = topics(o.federation, o.deviceId);
  }

  private log(level: 'info' | 'warn' | 'error', msg: string): void {
    this.o.log?.(level, msg);
  }

  private status(state: 'online' | 'offline'): string {
    return JSON.stringify({ device_id: this.o.deviceId, state });
  }

  start(): void {
    this.closed = false;
    this.open();
    this.watchdog = setInterval(() => void this.followBroker(), 5000);
  }

  private open(): void {
    const o = this.o;
    const client = o.connect(this.url, {
      clientId: `pfl-${o.deviceId}`,
      username: o.username,
      password: o.password,
      clean: false,
      protocolVersion: 4,
      keepalive: 60,
      reconnectPeriod: 1000,
      connectTimeout: 15_000,
      resubscribe: true,
      will: { topic: this.topics.status, payload: this.status('offline'), qos: 1, retain: true },
      ...o.extra,
    });
    this.client = client;
    client.on('connect', () => {
      if (client !== this.client) return;
      this.connected = true;
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
    client.on('error', (e) => this.log('warn', `broker: ${e.message}`));
  }

  /** 15 s without the broker: ask the server where it is now, and follow it if it moved. */
  private async followBroker(): Promise<void> {
    if (this.closed || this.connected || this.asking || !this.o.brokerNow || Date.now() - this.lastUp < 15_000) return;
    this.asking = true;
    try {
      const url = await this.o.brokerNow();
      this.lastUp = Date.now();
      if (url !== this.url && !this.closed) {
        this.log('warn', `the broker moved: ${this.url} -> ${url}`);
        const old = this.client;
        this.url = url;
        old?.end(true);
        this.open();
      }
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
