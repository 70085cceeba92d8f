/**
 * Enrolment and the token (docs/protocol.md, "A minimal device" step 1, "Credentials", "Messages"):
 *
 * - `enrol`: the enrolment kept in the state dir, or `POST /v1/devices` with the secret, the profile, the slot
 *   asked for and the nonce (stored before the request, so that a retry whose answer was lost gets the same device
 *   and slot back); the answer is stored (a private file) with its token before it is used.
 * - `Tokens`: the token is rotated (`POST /v1/devices/me/token`) at the first start after enrolling (to learn its
 *   expiry) and once half of its lifetime has passed, the new one saved before it is used; a rotation refused with
 *   401 (the chain's absolute lifetime is over) or a 401 on any call makes the device enrol again with its secret
 *   and nonce (`renew`: the same device and slot, a new chain).
 *
 * Platform-neutral.
 */
import type { webcrypto } from 'node:crypto';
import { DeviceKey, enrolMessage, rotateMessage } from './devicekey.js';
import { Http, HttpError } from './http.js';
import { type Enrolment, PROTOCOLS, parseEnrolment, parseTokenIssued } from './messages.js';
import type { StateStore, TokenRecord } from './state.js';

export interface EnrolConfig {
  federation: string;
  enrolSecret: string;
  profile: string;
  name: string;
  /** the slot it asks for (null: the lowest free one) */
  index: number | null;
  /** its training samples (null: not declared) */
  nSamples: number | null;
  /** what it says it is (pfl_edge.protocol.Platform; null: say nothing) */
  platform?: PlatformInfo | null;
  /** WebCrypto, for the device's own key (devicekey.ts); absent: it enrols without one, as an earlier release */
  subtle?: webcrypto.SubtleCrypto;
}

/** fields a server of an earlier release refuses (422): the device enrols again, once, without them */
const NEW_FIELDS = ['platform', 'public_key', 'proof', 'protocols'];

/** What a device says it is at enrolment (docs/protocol.md, "Enrolment"): reported, never verified. */
export interface PlatformInfo {
  /** CPU architecture as the OS or runtime names it: arm64, aarch64, x64, x86_64 */
  machine: string;
  os: string;
  /** the language runtime and its version, e.g. 'node 20.19.2' */
  language: string;
  /** the training runtime and its version, e.g. 'onnxruntime-node 1.31.1' */
  runtime: string;
  threads: number;
  cpus?: number | null;
}

/** A refusal the device cannot fix by trying again: it stops and says why. */
export class EnrolRefused extends Error {
  override name = 'EnrolRefused';
}

const now = (): number => Date.now() / 1e3;

async function ask(store: StateStore, http: Http, cfg: EnrolConfig, random: (n: number) => Uint8Array): Promise<Enrolment> {
  const nonce = await store.nonce(random); // on disk before the request leaves
  let body: unknown;
  const request: Record<string, unknown> = {
    federation: cfg.federation, enrol_secret: cfg.enrolSecret, profile: cfg.profile, name: cfg.name.slice(0, 64),
    index: cfg.index, nonce, n_samples: cfg.nSamples, protocols: PROTOCOLS,
  };
  if (cfg.platform) request['platform'] = cfg.platform;
  const key = cfg.subtle ? await DeviceKey.load(store, cfg.subtle) : null;
  // each attempt signed afresh: the server takes a counter once only
  const signed = async (): Promise<unknown> => key === null ? request : {
    ...request, public_key: key.publicKey,
    proof: await key.prove((c) => enrolMessage(cfg.federation, nonce, key.publicKey, c)),
  };
  try {
    try {
      body = (await http.call('POST', '/v1/devices', { jsonEach: signed, auth: false })).json();
    } catch (e) {
      // a server of an earlier release knows none of the newer fields and refuses them: enrol without them
      if (!(e instanceof HttpError && e.status === 422 && NEW_FIELDS.some((f) => e.detail.includes(f)))) throw e;
      delete request['platform'];
      delete request['protocols'];
      body = await http.postJson('/v1/devices', request, { auth: false });
    }
  } catch (e) {
    if (e instanceof HttpError && [403, 409, 422].includes(e.status)) {
      const why = e.status === 403 ? 'the enrol secret or federation is wrong, or this device was revoked'
        : e.status === 409 ? 'the federation is full, finished, or this slot is taken' : 'the request does not fit the federation';
      throw new EnrolRefused(`enrolment refused (${e.status}: ${e.detail}): ${why}`);
    }
    throw e;
  }
  const enr = parseEnrolment(body);
  if (enr.federation !== cfg.federation) throw new EnrolRefused(`enrolled in ${enr.federation}, not ${cfg.federation}`);
  await store.writeJson('enrolment.json', enr, true);
  await store.saveToken({ token: enr.token, expires: null, issued: now() });
  return enr;
}

/** The device's enrolment: the one kept in its state dir, else a new one. */
export async function enrol(store: StateStore, http: Http, cfg: EnrolConfig, random: (n: number) => Uint8Array): Promise<Enrolment> {
  const kept = await store.readJson<unknown>('enrolment.json');
  if (kept !== null) {
    const enr = parseEnrolment(kept);
    if (enr.federation !== cfg.federation) {
      throw new EnrolRefused(`the state dir belongs to federation ${enr.federation}, not ${cfg.federation}: use another --state-dir`);
    }
    return enr;
  }
  return ask(store, http, cfg, random);
}

/** Enrol again with the same nonce (its token chain ended): the same device and slot, a new token. */
export async function renew(store: StateStore, http: Http, cfg: EnrolConfig, old: Enrolment,
  random: (n: number) => Uint8Array): Promise<Enrolment> {
  const enr = await ask(store, http, cfg, random);
  if (enr.device_id !== old.device_id || enr.index !== old.index) {
    throw new EnrolRefused(`enrolling again gave device ${enr.device_id} slot ${enr.index}, not ${old.device_id} slot ${old.index}`);
  }
  return enr;
}

export class Tokens {
  constructor(
    readonly store: StateStore,
    readonly http: Http,
    private log: (msg: string) => void = () => undefined,
    /** WebCrypto: rotations are signed by the device's key (a device enrolled with one must sign them) */
    private subtle?: webcrypto.SubtleCrypto,
  ) {}

  /** Takes the saved token (or the enrolment's) into the HTTP client. */
  async load(enr: Enrolment): Promise<TokenRecord> {
    const t = (await this.store.token()) ?? { token: enr.token, expires: null, issued: now() };
    this.http.token = t.token;
    return t;
  }

  /** Is a rotation due: the expiry unknown, or half of the token's lifetime gone? */
  async due(at = now()): Promise<boolean> {
    const t = await this.store.token();
    if (t === null || t.expires === null) return true;
    return at >= t.issued + (t.expires - t.issued) / 2;
  }

  /** `POST /v1/devices/me/token`; the new token saved before it is used. A 401 is thrown (the caller renews). */
  async rotate(deviceId: string): Promise<TokenRecord> {
    const key = this.subtle ? await DeviceKey.load(this.store, this.subtle) : null;
    const body = key === null ? undefined : { proof: await key.prove((c) => rotateMessage(deviceId, c)) };
    const issued = parseTokenIssued(await this.http.postJson('/v1/devices/me/token', body, { retry: false }));
    if (issued.device_id !== deviceId) throw new Error(`the server rotated the token of ${issued.device_id}, not ${deviceId}`);
    const t: TokenRecord = { token: issued.token, expires: issued.expires, issued: now() };
    await this.store.saveToken(t);
    this.http.token = t.token;
    this.log(`token rotated; it expires at ${new Date(issued.expires * 1e3).toISOString()}`);
    return t;
  }
}
