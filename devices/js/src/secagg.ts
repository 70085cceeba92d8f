/**
 * SecAgg+'s client side (pfl-edge's docs/secagg.md, `pfl_edge/secagg/protocol.py`'s `Client`), byte for byte as
 * pfl-edge computes it (test/fixtures/secagg.json): X25519 and HKDF-SHA256 to a key of each use, AES-256-GCM for
 * the shares in transit, AES-256-CTR as the masks' generator, all from Web Crypto (Node 20, browsers); Shamir
 * sharing over GF(2^521 - 1) in BigInt; the update quantized as `pfl_edge.secagg.quantize` does. The steps over
 * HTTP are `runSecureRound`.
 */
import type { webcrypto } from 'node:crypto'; // types only (erased): Web Crypto's, as browsers and Node have it

import { toHex } from './sha256.js';

type SubtleCrypto = webcrypto.SubtleCrypto;
type CryptoKey = webcrypto.CryptoKey;
type CryptoKeyPair = webcrypto.CryptoKeyPair;

export class SecAggError extends Error {}

export const PRIME = (1n << 521n) - 1n;
export const SHARE_BYTES = 66;
const ENC = new TextEncoder();

export interface KeyPair {
  publicRaw: Uint8Array;
  secretRaw: Uint8Array;
  key: CryptoKey;
}

export interface Advert {
  c: Uint8Array;
  s: Uint8Array;
}

const B64 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_';

/** base64url without padding (a JWK's key fields), here: Buffer is Node's only. */
function b64url(b: Uint8Array): string {
  let out = '';
  for (let i = 0; i < b.length; i += 3) {
    const n = (b[i]! << 16) | ((b[i + 1] ?? 0) << 8) | (b[i + 2] ?? 0);
    const chars = Math.min(4, Math.ceil(((b.length - i) * 8) / 6));
    for (let k = 0; k < chars; k++) out += B64[(n >> (18 - 6 * k)) & 63];
  }
  return out;
}

function unb64url(s: string): Uint8Array {
  const out: number[] = [];
  let acc = 0;
  let have = 0;
  for (const ch of s) {
    const v = B64.indexOf(ch);
    if (v < 0) throw new SecAggError('not base64url');
    acc = (acc << 6) | v;
    have += 6;
    if (have >= 8) {
      have -= 8;
      out.push((acc >> have) & 0xff);
    }
  }
  return Uint8Array.from(out);
}

export function fromHex(h: string): Uint8Array {
  if (!/^([0-9a-f]{2})*$/.test(h)) throw new SecAggError('not lowercase hex');
  const out = new Uint8Array(h.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(h.slice(2 * i, 2 * i + 2), 16);
  return out;
}

function concat(...parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

const be32 = (v: number): Uint8Array => {
  const b = new Uint8Array(4);
  new DataView(b.buffer).setUint32(0, v, false);
  return b;
};

/** A fresh X25519 key pair; ``secret`` and ``public``: to import fixed ones (tests). */
export async function keyPair(subtle: SubtleCrypto, secret?: Uint8Array, pub?: Uint8Array): Promise<KeyPair> {
  if (secret !== undefined && pub !== undefined) {
    const key = await subtle.importKey('jwk', { kty: 'OKP', crv: 'X25519', d: b64url(secret), x: b64url(pub) },
      { name: 'X25519' }, true, ['deriveBits']);
    return { publicRaw: pub, secretRaw: secret, key };
  }
  const k = (await subtle.generateKey({ name: 'X25519' }, true, ['deriveBits'])) as CryptoKeyPair;
  const jwk = await subtle.exportKey('jwk', k.privateKey);
  return { publicRaw: new Uint8Array(await subtle.exportKey('raw', k.publicKey)),
    secretRaw: unb64url(jwk.d!), key: k.privateKey };
}

/** A 32-byte key both ends derive: HKDF-SHA256 (no salt) of the X25519 shared secret, bound to ``info``. */
export async function agree(subtle: SubtleCrypto, mine: KeyPair, theirs: Uint8Array, info: Uint8Array): Promise<Uint8Array> {
  if (theirs.length !== 32) throw new SecAggError(`an X25519 public key is 32 bytes, got ${theirs.length}`);
  const peer = await subtle.importKey('raw', theirs, { name: 'X25519' }, false, []);
  let shared: Uint8Array;
  try {
    shared = new Uint8Array(await subtle.deriveBits({ name: 'X25519', public: peer }, mine.key, 256));
  } catch {
    throw new SecAggError('unusable public key: a low-order point');
  }
  if (shared.every((v) => v === 0)) throw new SecAggError('unusable public key: a low-order point');
  const hk = await subtle.importKey('raw', shared, 'HKDF', false, ['deriveBits']);
  return new Uint8Array(await subtle.deriveBits({ name: 'HKDF', hash: 'SHA-256', salt: new Uint8Array(32), info }, hk, 256));
}

export async function seal(subtle: SubtleCrypto, key: Uint8Array, plain: Uint8Array, aad: Uint8Array, nonce: Uint8Array): Promise<Uint8Array> {
  const k = await subtle.importKey('raw', key, 'AES-GCM', false, ['encrypt']);
  return concat(nonce, new Uint8Array(await subtle.encrypt({ name: 'AES-GCM', iv: nonce, additionalData: aad, tagLength: 128 }, k, plain)));
}

export async function openSealed(subtle: SubtleCrypto, key: Uint8Array, sealed: Uint8Array, aad: Uint8Array): Promise<Uint8Array> {
  if (sealed.length < 28) throw new SecAggError('a sealed share is too short');
  const k = await subtle.importKey('raw', key, 'AES-GCM', false, ['decrypt']);
  try {
    return new Uint8Array(await subtle.decrypt({ name: 'AES-GCM', iv: sealed.subarray(0, 12), additionalData: aad, tagLength: 128 },
      k, sealed.subarray(12)));
  } catch {
    throw new SecAggError('a sealed share does not open: forged, altered, or not for this pair and round');
  }
}

/** ``n`` pseudo-random uint32 from a 32-byte seed: AES-256-CTR's keystream from a zero counter, little-endian. */
export async function prg(subtle: SubtleCrypto, seed: Uint8Array, n: number): Promise<Uint32Array> {
  if (seed.length !== 32) throw new SecAggError(`a mask seed is 32 bytes, got ${seed.length}`);
  const k = await subtle.importKey('raw', seed, 'AES-CTR', false, ['encrypt']);
  const ks = new DataView(await subtle.encrypt({ name: 'AES-CTR', counter: new Uint8Array(16), length: 128 }, k, new Uint8Array(4 * n)));
  const out = new Uint32Array(n);
  for (let i = 0; i < n; i++) out[i] = ks.getUint32(4 * i, true);
  return out;
}

const toBig = (b: Uint8Array): bigint => (b.length ? BigInt('0x' + toHex(b)) : 0n);

function toBytes(v: bigint, size: number): Uint8Array {
  return fromHex(v.toString(16).padStart(2 * size, '0'));
}

/** A uniform field element below PRIME, from ``random`` (66 bytes, 521 bits kept, larger ones drawn again). */
export function fieldElement(random: (n: number) => Uint8Array): bigint {
  for (;;) {
    const b = random(SHARE_BYTES);
    b[0] = b[0]! & 0x01;
    const v = toBig(b);
    if (v < PRIME) return v;
  }
}

/** Shamir shares of ``secret`` at the points ``xs``: f(x) = secret + a_1 x + ... (``coeffs``: a_1 ...). */
export function split(secret: Uint8Array, xs: readonly number[], coeffs: readonly bigint[]): Map<number, Uint8Array> {
  const all = [toBig(secret), ...coeffs];
  const out = new Map<number, Uint8Array>();
  for (const x of xs) {
    let y = 0n;
    for (let i = all.length - 1; i >= 0; i--) y = (y * BigInt(x) + all[i]!) % PRIME;
    out.set(x, toBytes(y, SHARE_BYTES));
  }
  return out;
}

/** ``x`` (float64) clipped to [-bound, bound] and mapped to [0, 2^bits - 1], rounded half to even, as numpy. */
export function quantize(x: ArrayLike<number>, bound: number, bits: number): Uint32Array {
  const levels = 2 ** bits - 1;
  return Uint32Array.from({ length: x.length }, (_, i) => {
    const v = ((Math.min(Math.max(x[i]!, -bound), bound) + bound) / (2 * bound)) * levels;
    const f = Math.floor(v);
    const d = v - f;
    return d > 0.5 ? f + 1 : d < 0.5 ? f : f % 2 === 0 ? f : f + 1;
  });
}

/** One client's side of a round (pfl_edge.secagg.protocol.Client): its secrets leave it only as Shamir shares. */
export class SecureClient {
  neighbours = new Map<number, Advert>();
  held = new Map<number, [Uint8Array, Uint8Array]>();
  revealed = new Map<number, 'b' | 's'>();
  /** Neighbours whose pair for it did not open or held shares other than they committed to. */
  accused = new Set<number>();

  constructor(readonly subtle: SubtleCrypto, readonly cid: number, readonly roundId: string, readonly threshold: number,
    readonly size: number, readonly c: KeyPair, readonly s: KeyPair, readonly b: Uint8Array,
    readonly random: (n: number) => Uint8Array) {}

  private aad(sender: number, receiver: number): Uint8Array {
    return concat(ENC.encode('pfl-secagg:' + this.roundId), be32(sender), be32(receiver));
  }

  private info(kind: string): Uint8Array {
    return ENC.encode(`pfl-secagg:${kind}:${this.roundId}`);
  }

  /**
   * The dealer's commitment to the share of its secret `kind` that `holder` holds (pfl_edge.secagg.verify.commitment):
   * SHA-256 of "pfl-secagg-commit:<kind>:", the round id, the dealer and the holder (big-endian uint32), the share.
   */
  async commitment(kind: 'b' | 's', dealer: number, holder: number, share: Uint8Array): Promise<Uint8Array> {
    const msg = concat(ENC.encode(`pfl-secagg-commit:${kind}:${this.roundId}`), be32(dealer), be32(holder), share);
    return new Uint8Array(await this.subtle.digest('SHA-256', msg));
  }

  /** For each neighbour, by its id: the sealed pair of shares (of b, of the ``s`` key) and its commitments to them. */
  async shareKeys(neighbours: Map<number, Advert>): Promise<Map<number, [Uint8Array, Uint8Array]>> {
    if (neighbours.size < this.threshold || neighbours.has(this.cid)) {
      throw new SecAggError(`${neighbours.size} neighbours: fewer than the threshold ${this.threshold}`);
    }
    this.neighbours = new Map(neighbours);
    const ids = [...neighbours.keys()].sort((a, b) => a - b);
    const xs = ids.map((j) => j + 1);
    const coeffs = (): bigint[] => Array.from({ length: this.threshold - 1 }, () => fieldElement(this.random));
    const sb = split(this.b, xs, coeffs());
    const ss = split(this.s.secretRaw, xs, coeffs());
    const out = new Map<number, [Uint8Array, Uint8Array]>();
    for (const j of ids) {
      const key = await agree(this.subtle, this.c, neighbours.get(j)!.c, this.info('c'));
      const body = concat(be32(this.cid), be32(j), sb.get(j + 1)!, ss.get(j + 1)!);
      const commits = concat(await this.commitment('b', this.cid, j, sb.get(j + 1)!),
        await this.commitment('s', this.cid, j, ss.get(j + 1)!));
      out.set(j, [await seal(this.subtle, key, body, this.aad(this.cid, j), this.random(12)), commits]);
    }
    return out;
  }

  /** The pair `dealer` sealed for it, opened and checked against the dealer's commitments (SecAggError otherwise). */
  private async openPair(dealer: number, box: Uint8Array, commits: Uint8Array): Promise<[Uint8Array, Uint8Array]> {
    const adv = this.neighbours.get(dealer)!;
    const body = await openSealed(this.subtle, await agree(this.subtle, this.c, adv.c, this.info('c')), box, this.aad(dealer, this.cid));
    const hdr = concat(be32(dealer), be32(this.cid));
    if (body.length !== 8 + 2 * SHARE_BYTES || hdr.some((v, i) => body[i] !== v)) {
      throw new SecAggError(`the pair from ${dealer} is not addressed to this client`);
    }
    const sb = body.slice(8, 8 + SHARE_BYTES);
    const ss = body.slice(8 + SHARE_BYTES);
    const want = concat(await this.commitment('b', dealer, this.cid, sb), await this.commitment('s', dealer, this.cid, ss));
    if (commits.length !== want.length || want.some((v, i) => commits[i] !== v)) {
      throw new SecAggError(`the pair from ${dealer} holds shares other than the ones it committed to`);
    }
    return [sb, ss];
  }

  /** The complaint it sends when `accused` is not empty: its sealing secret of this round and the dealers it accuses. */
  complaint(): { c_secret: string; accused: number[] } {
    return { c_secret: toHex(this.c.secretRaw), accused: [...this.accused].sort((a, b) => a - b) };
  }

  /**
   * y = x + the masks (mod 2^32), after opening the pairs its neighbours sealed for it (with their commitments). A pair
   * that does not open or check is not used: its dealer goes in `accused`, and it masks only with the pairs it holds.
   */
  async maskedInput(x: Uint32Array, sealed: Map<number, [Uint8Array, Uint8Array]>): Promise<Uint32Array> {
    if (x.length !== this.size) throw new SecAggError(`the input must hold ${this.size} values`);
    const senders = [...sealed.keys()].sort((a, b) => a - b);
    for (const j of senders) {
      if (!this.neighbours.has(j)) throw new SecAggError(`a share from ${j}, not a neighbour`);
      try {
        this.held.set(j, await this.openPair(j, ...sealed.get(j)!));
      } catch (e) {
        if (!(e instanceof SecAggError)) throw e;
        this.accused.add(j);
      }
    }
    const y = Uint32Array.from(x);
    const own = await prg(this.subtle, this.b, this.size);
    for (let i = 0; i < y.length; i++) y[i] = (y[i]! + own[i]!) >>> 0;
    for (const j of senders.filter((k) => this.held.has(k))) {
      const m = await prg(this.subtle, await agree(this.subtle, this.s, this.neighbours.get(j)!.s, this.info('s')), this.size);
      const sign = this.cid < j ? 1 : -1;
      for (let i = 0; i < y.length; i++) y[i] = (y[i]! + sign * m[i]!) >>> 0;
    }
    return y;
  }

  /** Per neighbour whose shares it holds: the share of its b if it survived, of its ``s`` key if it dropped. */
  unmask(survivors: Set<number>, dropped: Set<number>): Array<{ about: number; kind: 'b' | 's'; share: string }> {
    if ([...survivors].some((j) => dropped.has(j)) || survivors.size < this.threshold || !survivors.has(this.cid)) {
      throw new SecAggError('an unmask request naming a client both ways, fewer survivors than the threshold, or not this client');
    }
    const out: Array<{ about: number; kind: 'b' | 's'; share: string }> = [];
    for (const [j, [sb, ss]] of [...this.held].sort((a, b) => a[0] - b[0])) {
      const kind = survivors.has(j) ? 'b' : dropped.has(j) ? 's' : null;
      if (kind === null) continue;
      if ((this.revealed.get(j) ?? kind) !== kind) throw new SecAggError(`client ${j}: its other secret's share was revealed already`);
      this.revealed.set(j, kind);
      out.push({ about: j, kind, share: toHex(kind === 'b' ? sb : ss) });
    }
    return out;
  }
}

/** The masked input's payload (docs/codec.md, section 10): PFLM, version 1, round, count, little-endian uint32. */
export function encodeMasked(y: Uint32Array, t: number): Uint8Array {
  const out = new Uint8Array(13 + 4 * y.length);
  const dv = new DataView(out.buffer);
  out.set(ENC.encode('PFLM'), 0);
  dv.setUint8(4, 1);
  dv.setUint32(5, t, true);
  dv.setUint32(9, y.length, true);
  for (let i = 0; i < y.length; i++) dv.setUint32(13 + 4 * i, y[i]!, true);
  return out;
}

/** The most bits per coordinate whose sum over ``clients`` cannot wrap around 2^32 (pfl_edge.privacy.max_bits). */
export const maxBits = (clients: number): number => Math.min(31, 32 - Math.ceil(Math.log2(clients + 1)));
