/**
 * The device's HTTP client (docs/protocol.md, "HTTP API", "Errors", "Failures"), on the platform's `fetch`
 * (Node 20, React Native): `Authorization: Bearer <token>`, bodies read with a bound (refused past `maxBytes`
 * before they are held), network errors, 408 and 5xx retried with back-off (0.5 s doubling to 10 s) for
 * `patienceS` seconds, a 503's or 429's `Retry-After` waited, and every other status answered as an `HttpError`
 * carrying the server's `detail` (a 401 included: the caller rotates or enrols again). Platform-neutral.
 */

export class HttpError extends Error {
  override name = 'HttpError';
  constructor(
    readonly status: number,
    readonly detail: string,
    readonly method: string,
    readonly path: string,
    readonly retryAfterS: number | null = null,
  ) {
    super(`${method} ${path}: ${status} ${detail}`);
  }
}

/** The server stayed unreachable (or kept answering 5xx) for the whole patience. */
export class Unreachable extends Error {
  override name = 'Unreachable';
}

/** The device is shutting down: a wait was cut short. */
export class Stopped extends Error {
  override name = 'Stopped';
}

export interface HttpAnswer {
  status: number;
  headers: Headers;
  bytes: Uint8Array;
  json(): unknown;
}

export interface CallOptions {
  /** a JSON body, or a function that makes one for each attempt (a signed body is signed afresh for a retry) */
  json?: unknown;
  jsonEach?: () => Promise<unknown>;
  /** a bytes body (`application/octet-stream`) */
  body?: Uint8Array;
  /** send the bearer token (default true) */
  auth?: boolean;
  /** refuse an answer larger than this (default 1 MiB) */
  maxBytes?: number;
  /** retry 5xx and network errors (default true) */
  retry?: boolean;
}

export interface HttpOptions {
  /** how long to keep retrying an unreachable server, seconds (default 300) */
  patienceS?: number;
  /** one attempt's time limit, seconds (default 300) */
  timeoutS?: number;
  /** where `fetch` comes from (default the global one) */
  fetch?: typeof fetch;
  /** cut waits short and refuse new calls once aborted */
  signal?: AbortSignal;
  log?: (level: 'info' | 'warn' | 'error', msg: string) => void;
  /** the longest `Retry-After` honoured, seconds (default 60) */
  maxRetryAfterS?: number;
  /** back-off bounds, seconds (default 0.5 and 10) */
  backoffS?: [number, number];
}

export const DEFAULT_MAX_JSON = 1 << 20;

export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(new Stopped('stopped'));
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(new Stopped('stopped'));
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

/** The `detail` of an ErrorBody, as text (a 422's list of issues joined). */
export function errorDetail(bytes: Uint8Array): string {
  const text = new TextDecoder().decode(bytes.subarray(0, 8192));
  try {
    const body = JSON.parse(text) as { detail?: unknown };
    if (typeof body.detail === 'string') return body.detail;
    if (Array.isArray(body.detail)) {
      return body.detail.map((i: { loc?: unknown[]; msg?: string }) => `${(i.loc ?? []).join('.')}: ${i.msg ?? ''}`).join('; ');
    }
  } catch {
    // not JSON (a proxy's page): the text itself
  }
  return text.slice(0, 300);
}

function retryAfter(h: Headers): number | null {
  const v = h.get('retry-after');
  if (v === null || !/^\s*\d+(\.\d+)?\s*$/.test(v)) return null;
  return Number(v);
}

async function readBounded(res: Response, maxBytes: number, what: string): Promise<Uint8Array> {
  const declared = res.headers.get('content-length');
  if (declared !== null && Number(declared) > maxBytes) {
    await res.body?.cancel().catch(() => undefined);
    throw new HttpError(res.status, `answer of ${declared} bytes is over this device's bound of ${maxBytes}`, 'GET', what);
  }
  if (res.body === null || typeof res.body.getReader !== 'function') {
    const b = new Uint8Array(await res.arrayBuffer()); // a runtime without streamed bodies
    if (b.length > maxBytes) throw new HttpError(res.status, `answer over this device's bound of ${maxBytes} bytes`, 'GET', what);
    return b;
  }
  const reader = res.body.getReader();
  const parts: Uint8Array[] = [];
  let total = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    total += value.length;
    if (total > maxBytes) {
      await reader.cancel().catch(() => undefined);
      throw new HttpError(res.status, `answer over this device's bound of ${maxBytes} bytes`, 'GET', what);
    }
    parts.push(value);
  }
  if (parts.length === 1) return parts[0]!;
  const out = new Uint8Array(total);
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

export class Http {
  /** the bearer token sent with every authenticated call */
  token: string | null = null;
  private readonly fetch: typeof fetch;

  constructor(
    readonly baseUrl: string,
    readonly opts: HttpOptions = {},
  ) {
    if (!/^https?:\/\//.test(baseUrl)) throw new Error(`the server must be an http(s) URL, got ${baseUrl}`);
    this.baseUrl = baseUrl.replace(/\/+$/, '');
    this.fetch = opts.fetch ?? globalThis.fetch.bind(globalThis);
  }

  async call(method: string, path: string, o: CallOptions = {}): Promise<HttpAnswer> {
    const patience = (this.opts.patienceS ?? 300) * 1e3;
    const [lo, hi] = this.opts.backoffS ?? [0.5, 10];
    const maxRetryAfter = this.opts.maxRetryAfterS ?? 60;
    const maxBytes = o.maxBytes ?? DEFAULT_MAX_JSON;
    const signal = this.opts.signal;
    const started = Date.now();
    let delay = lo;
    for (let attempt = 0; ; attempt++) {
      if (signal?.aborted) throw new Stopped('stopped');
      const headers: Record<string, string> = { accept: 'application/json' };
      let body: Uint8Array | string | undefined;
      if (o.json !== undefined || o.jsonEach !== undefined) {
        headers['content-type'] = 'application/json';
        body = JSON.stringify(o.jsonEach !== undefined ? await o.jsonEach() : o.json);
      } else if (o.body !== undefined) {
        headers['content-type'] = 'application/octet-stream';
        body = o.body;
      }
      if (o.auth !== false) {
        if (this.token === null) throw new Error(`${method} ${path} needs a token and this device has none yet`);
        headers['authorization'] = `Bearer ${this.token}`;
      }
      const ac = new AbortController();
      const onStop = (): void => ac.abort();
      signal?.addEventListener('abort', onStop, { once: true });
      const timer = setTimeout(() => ac.abort(), (this.opts.timeoutS ?? 300) * 1e3);
      let wait: number | null = null;
      let why = '';
      try {
        const res = await this.fetch(this.baseUrl + path, { method, headers, body, signal: ac.signal });
        if (res.status >= 200 && res.status < 300) {
          const bytes = await readBounded(res, maxBytes, path);
          return { status: res.status, headers: res.headers, bytes, json: () => JSON.parse(new TextDecoder().decode(bytes)) };
        }
        const detailBytes = await readBounded(res, 64 * 1024, path).catch(() => new Uint8Array());
        const detail = errorDetail(detailBytes);
        const ra = retryAfter(res.headers);
        const retryable = o.retry !== false && (res.status >= 500 || res.status === 408 || (res.status === 429 && ra !== null));
        if (!retryable) throw new HttpError(res.status, detail, method, path, ra);
        why = `${res.status} ${detail}`;
        wait = ra !== null ? Math.min(ra, maxRetryAfter) : delay;
      } catch (e) {
        if (e instanceof HttpError) throw e;
        if (signal?.aborted) throw new Stopped('stopped');
        if (o.retry === false) throw e;
        why = e instanceof Error ? `${e.message}${e.cause instanceof Error ? ` (${e.cause.message})` : ''}` : String(e);
        wait = delay;
      } finally {
        clearTimeout(timer);
        signal?.removeEventListener('abort', onStop);
      }
      if (Date.now() - started + wait * 1e3 > patience) {
        throw new Unreachable(`${method} ${path}: gave up after ${((Date.now() - started) / 1e3).toFixed(0)} s: ${why}`);
      }
      this.opts.log?.(attempt === 0 ? 'info' : 'warn', `${method} ${path}: ${why}; again in ${wait.toFixed(1)} s`);
      await sleep(wait * 1e3, signal);
      delay = Math.min(delay * 2, hi);
    }
  }

  async getJson(path: string, o: CallOptions = {}): Promise<unknown> {
    return (await this.call('GET', path, o)).json();
  }

  async postJson(path: string, json: unknown, o: CallOptions = {}): Promise<unknown> {
    return (await this.call('POST', path, { ...o, json })).json();
  }
}
