/**
 * The device's own key (docs/protocol.md, "Device keys"; `pfl_edge/device_key.py` defines the same messages):
 * an Ed25519 key pair made with WebCrypto before the first enrolment and kept private in the state dir
 * (`device-key.json`: the raw private key and public key, hex, and the signing counter). Every enrolment attempt
 * and token rotation is signed with a counter raised and saved first, so whoever learns the nonce or steals the
 * token cannot take this device's slot while the key stays here. Platform-neutral (Node.js 20 and browsers both
 * have Ed25519 in WebCrypto; without WebCrypto the device enrols without a key, as an earlier release did).
 */
import type { webcrypto } from 'node:crypto';
import type { StateStore } from './state.js';

type Subtle = webcrypto.SubtleCrypto;
type Key = webcrypto.CryptoKey;

const ENC = new TextEncoder();
const FILE = 'device-key.json';
const HEX64 = /^[0-9a-f]{64}$/;

const hex = (b: Uint8Array): string => [...b].map((x) => x.toString(16).padStart(2, '0')).join('');
const unhex = (s: string): Uint8Array => new Uint8Array(s.match(/../g)!.map((x) => parseInt(x, 16)));
const b64url = (b: Uint8Array): string => btoa(String.fromCharCode(...b)).replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '');
const unb64url = (s: string): Uint8Array =>
  new Uint8Array([...atob(s.replace(/-/g, '+').replace(/_/g, '/'))].map((c) => c.charCodeAt(0)));

const message = (...fields: string[]): Uint8Array => ENC.encode(fields.join('\0'));

/** What an enrolment's proof signs (pfl_edge.device_key.enrol_message). */
export const enrolMessage = (federation: string, nonce: string, publicKey: string, counter: number): Uint8Array =>
  message('pfl-enrol/1', federation, nonce, publicKey, String(counter));

/** What a token rotation's proof signs (pfl_edge.device_key.rotate_message). */
export const rotateMessage = (deviceId: string, counter: number): Uint8Array =>
  message('pfl-rotate/1', deviceId, String(counter));

export interface KeyProof {
  counter: number;
  signature: string;
}

interface Saved {
  key: string;
  public: string;
  counter: number;
}

export class DeviceKey {
  private constructor(
    private readonly store: StateStore,
    private readonly subtle: Subtle,
    private readonly key: Key,
    private readonly saved: Saved,
  ) {}

  /** The Ed25519 public key, 64 hex characters (what the server keeps). */
  get publicKey(): string {
    return this.saved.public;
  }

  /** The key kept in the state dir, or a new one (saved before it is used). */
  static async load(store: StateStore, subtle: Subtle): Promise<DeviceKey> {
    let saved = await store.readJson<Saved>(FILE);
    if (saved === null || !HEX64.test(saved.key) || !HEX64.test(saved.public) || !Number.isSafeInteger(saved.counter)) {
      const pair = (await subtle.generateKey({ name: 'Ed25519' }, true, ['sign', 'verify'])) as webcrypto.CryptoKeyPair;
      const jwk = await subtle.exportKey('jwk', pair.privateKey);
      saved = { key: hex(unb64url(jwk.d!)), public: hex(new Uint8Array(await subtle.exportKey('raw', pair.publicKey))), counter: 0 };
      await store.writeJson(FILE, saved, true);
    }
    const key = await subtle.importKey('jwk', { kty: 'OKP', crv: 'Ed25519', d: b64url(unhex(saved.key)), x: b64url(unhex(saved.public)) },
      { name: 'Ed25519' }, false, ['sign']);
    return new DeviceKey(store, subtle, key, saved);
  }

  /** A proof over `msg(counter)` with the next counter, saved before the signature leaves (never signed twice). */
  async prove(msg: (counter: number) => Uint8Array): Promise<KeyProof> {
    this.saved.counter += 1;
    await this.store.writeJson(FILE, this.saved, true);
    const sig = new Uint8Array(await this.subtle.sign({ name: 'Ed25519' }, this.key, msg(this.saved.counter)));
    return { counter: this.saved.counter, signature: hex(sig) };
  }
}
