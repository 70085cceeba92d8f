/**
 * The protocol's messages a device reads (docs/schemas/*.json), checked as their schemas say: every field's type
 * and bounds, required fields present; a field it does not know is left out, not refused (docs/protocol.md,
 * "Versions": a device of protocol version 2 reads what the server sends tolerantly, so additive changes never
 * break it). A message that fails is a `MessageError` (from MQTT: dropped; from the server: a protocol error).
 * Platform-neutral.
 */

export class MessageError extends Error {
  override name = 'MessageError';
}

type Check = (v: unknown) => boolean;
type Spec = Record<string, [Check, boolean]>; // field -> (check, required)

const ID = /^[A-Za-z0-9_-]{1,64}$/;
const SHA = /^[0-9a-f]{64}$/;

const isInt = (lo: number, hi: number): Check => (v) => typeof v === 'number' && Number.isSafeInteger(v) && v >= lo && v <= hi;
const isNum = (lo: number, hi: number): Check => (v) => typeof v === 'number' && Number.isFinite(v) && v >= lo && v <= hi;
const isStr = (max: number, re?: RegExp): Check => (v) => typeof v === 'string' && v.length <= max && (re === undefined || re.test(v));
const isBool: Check = (v) => typeof v === 'boolean';
const orNull = (c: Check): Check => (v) => v === null || c(v);
const isObj = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);

/** The protocol versions this device speaks (docs/protocol.md, "Versions"), said at enrolment. */
export const PROTOCOLS = [1, 2];

function check<T>(name: string, spec: Spec, v: unknown): T {
  if (!isObj(v)) throw new MessageError(`${name}: not a JSON object`);
  const out: Record<string, unknown> = {}; // only the fields it knows: one added since is ignored
  for (const [k, [ok, required]] of Object.entries(spec)) {
    if (!Object.prototype.hasOwnProperty.call(v, k)) {
      if (required) throw new MessageError(`${name}: ${k} is missing`);
      continue;
    }
    if (!ok(v[k])) throw new MessageError(`${name}: ${k} is not valid: ${JSON.stringify(v[k])?.slice(0, 100)}`);
    out[k] = v[k];
  }
  return out as T;
}

export interface Neighbour {
  index: number;
  device_id: string;
  digest: string;
}

export interface Task {
  federation: string;
  round: number;
  algorithm: string;
  base?: string | null;
  neighbours?: Neighbour[];
  deadline: number;
  final?: boolean;
  /** the protocol version it is sent in (absent: 1) */
  protocol?: number | null;
}

const NEIGHBOUR: Spec = {
  index: [isInt(0, 99_999), true],
  device_id: [isStr(64, ID), true],
  digest: [isStr(64, SHA), true],
};

export function parseTask(v: unknown): Task {
  const t = check<Task>('Task', {
    federation: [isStr(64, ID), true],
    round: [isInt(0, 1_000_000), true],
    algorithm: [isStr(256), true],
    base: [orNull(isStr(64, SHA)), false],
    neighbours: [(n) => Array.isArray(n) && n.length <= 1000, false],
    deadline: [isNum(0, 1e11), true],
    final: [isBool, false],
    protocol: [orNull(isInt(1, 1000)), false],
  }, v);
  t.neighbours = (t.neighbours ?? []).map((n) => check<Neighbour>('Neighbour', NEIGHBOUR, n));
  t.base = t.base ?? null;
  t.final = t.final ?? false;
  return t;
}

export interface RoundAnnouncement {
  federation: string;
  round: number;
  state: 'open' | 'collecting' | 'closing' | 'published' | 'finished';
  base?: string | null;
  deadline?: number | null;
}

export function parseAnnouncement(v: unknown): RoundAnnouncement {
  return check<RoundAnnouncement>('RoundAnnouncement', {
    federation: [isStr(64, ID), true],
    round: [isInt(0, 1_000_000), true],
    state: [(s) => ['open', 'collecting', 'closing', 'published', 'finished'].includes(s as string), true],
    base: [orNull(isStr(64, SHA)), false],
    deadline: [orNull(isNum(0, 1e11)), false],
  }, v);
}

export interface Enrolment {
  device_id: string;
  token: string;
  index: number;
  federation: string;
  config: Record<string, unknown>;
  density: number;
  kp: number;
  broker_url: string;
  mqtt_username: string;
  mqtt_password: string;
  round: number;
  init_digest: string;
  init_model?: string | null;
  /** its MQTT client id, which no other device can guess; absent (a server of an earlier release): `pfl-<device_id>` */
  mqtt_client_id?: string | null;
  /** the protocol version the server answers it in; absent: 1 */
  protocol?: number | null;
}

export function parseEnrolment(v: unknown): Enrolment {
  return check<Enrolment>('Enrolment', {
    device_id: [isStr(64, ID), true],
    token: [isStr(256), true],
    index: [isInt(0, 99_999), true],
    federation: [isStr(64, ID), true],
    config: [(c) => isObj(c) && Object.keys(c).length <= 64, true],
    density: [(d) => typeof d === 'number' && d > 0 && d <= 1, true],
    kp: [isInt(0, 1000), true],
    broker_url: [isStr(2048, /^mqtts?:\/\//), true],
    mqtt_username: [isStr(256), true],
    mqtt_password: [isStr(4096), true], // a plain password, or a token broker's JWT (~1,100-1,300 characters)
    round: [isInt(0, 1_000_000), true],
    init_digest: [isStr(64, SHA), true],
    init_model: [orNull(isStr(64, SHA)), false],
    mqtt_client_id: [orNull(isStr(36, /^pfl-[0-9a-f]{32}$/)), false],
    protocol: [orNull(isInt(1, 1000)), false],
  }, v);
}

export interface TokenIssued {
  device_id: string;
  token: string;
  expires: number;
}

export function parseTokenIssued(v: unknown): TokenIssued {
  return check<TokenIssued>('TokenIssued', {
    device_id: [isStr(64, ID), true],
    token: [isStr(256), true],
    expires: [isNum(0, 1e11), true],
  }, v);
}

/** `GET /v1/devices/me/broker`: where the broker is now, and (token brokers only) a fresh MQTT password. */
export interface BrokerInfo {
  broker_url: string;
  mqtt_password?: string | null;
}

export function parseBrokerInfo(v: unknown): BrokerInfo {
  const b = check<BrokerInfo>('BrokerInfo', {
    broker_url: [isStr(2048, /^mqtts?:\/\//), true],
    mqtt_password: [orNull(isStr(4096)), false],
  }, v);
  b.mqtt_password = b.mqtt_password ?? null;
  return b;
}

export interface UpdateAccepted {
  round: number;
  accepted: boolean;
  updates: number;
}

export function parseUpdateAccepted(v: unknown): UpdateAccepted {
  return check<UpdateAccepted>('UpdateAccepted', {
    round: [isInt(0, 1_000_000), true],
    accepted: [isBool, true],
    updates: [isInt(0, Number.MAX_SAFE_INTEGER), true],
  }, v);
}

/** The fields of FederationInfo a device reads (the others are let through: an answer, not an instruction). */
export function federationState(v: unknown): { state: string; round: number } {
  if (!isObj(v) || typeof v['state'] !== 'string' || !Number.isSafeInteger(v['round'])) {
    throw new MessageError('FederationInfo: no state and round');
  }
  return { state: v['state'], round: v['round'] as number };
}

/** The round topic and a device's task and status topics (docs/protocol.md, "MQTT topics"). */
export const topics = (fed: string, dev: string): { round: string; task: string; status: string } => ({
  round: `pfl/${fed}/round`,
  task: `pfl/${fed}/device/${dev}/task`,
  status: `pfl/${fed}/device/${dev}/status`,
});
