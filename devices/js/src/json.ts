/**
 * The JSON the payload header needs (docs/codec.md section 2), which `JSON.parse` cannot give:
 *
 * - integers and non-integers stay apart (`3` is an integer, `3.0` and `3e0` are not) and integers are exact
 *   (`bigint`), whatever their size;
 * - a duplicate key in any object is refused (after unescaping: `"w"` and `"\u0077"` are the same key);
 * - `NaN`, `Infinity` and `-Infinity` are refused with their own message;
 * - the text is strict RFC 8259 otherwise: whitespace is space, tab, LF, CR only; no raw control characters in
 *   strings; no trailing garbage.
 *
 * Plus {@link dumps}, which writes a value exactly as Python's `json.dumps(obj, separators=(",", ":"))` does
 * (pure ASCII, `\u` escapes in lowercase hex), and {@link pyRepr}, which renders a value the way Python's `repr`
 * does, so that refusal messages read like pfl-edge's.
 */

/** A JSON number with no fraction and no exponent. */
export class JInt {
  constructor(readonly value: bigint) {}
}

/** A JSON number with a fraction or an exponent (`raw` is its text; `value` may be +-Infinity for `1e400`). */
export class JFloat {
  constructor(
    readonly value: number,
    readonly raw: string,
  ) {}
}

export type JValue = null | boolean | string | JInt | JFloat | JValue[] | JObject;

/** A JSON object; key order as written, keys unique. */
export class JObject {
  constructor(readonly entries: Map<string, JValue>) {}
}

export class JsonError extends Error {
  constructor(
    message: string,
    /** "duplicate" for a repeated key, "constant" for NaN/Infinity, "syntax" otherwise */
    readonly kind: 'syntax' | 'duplicate' | 'constant',
  ) {
    super(message);
    this.name = 'JsonError';
  }
}

/** Deeper than any header can be (an entry's shape is at depth 4); bounds the parser's recursion. */
export const MAX_DEPTH = 512;
/** CPython refuses integers of more digits (its int/str conversion limit); so does this parser. */
export const MAX_INT_DIGITS = 4300;

const WS = (c: number): boolean => c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d;

/** Parses one JSON text (the whole string) into {@link JValue}s. */
export function parse(text: string): JValue {
  let i = 0;
  const n = text.length;

  const fail = (what: string): never => {
    throw new JsonError(`${what} at char ${i}`, 'syntax');
  };
  const skip = (): void => {
    while (i < n && WS(text.charCodeAt(i))) i++;
  };

  const parseString = (): string => {
    // text[i] is the opening quote
    i++;
    let out = '';
    let start = i;
    for (;;) {
      if (i >= n) fail('unterminated string');
      const c = text.charCodeAt(i);
      if (c === 0x22) {
        out += text.slice(start, i);
        i++;
        return out;
      }
      if (c < 0x20) fail('invalid control character in a string');
      if (c !== 0x5c) {
        i++;
        continue;
      }
      out += text.slice(start, i);
      i++;
      if (i >= n) fail('unterminated string');
      const e = text[i]!;
      i++;
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          const hex = text.slice(i, i + 4);
          if (!/^[0-9a-fA-F]{4}$/.test(hex)) fail('invalid \\u escape');
          out += String.fromCharCode(parseInt(hex, 16));
          i += 4;
          break;
        }
        default:
          i--;
          fail('invalid escape');
      }
      start = i;
    }
  };

  const parseNumber = (): JInt | JFloat => {
    const m = /^-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/.exec(sliceNumber(text, i));
    if (!m) return fail('invalid number');
    const raw = m[0];
    i += raw.length;
    if (m[1] === undefined && m[2] === undefined) {
      const digits = raw.startsWith('-') ? raw.length - 1 : raw.length;
      if (digits > MAX_INT_DIGITS) fail(`an integer of over ${MAX_INT_DIGITS} digits`);
      return new JInt(BigInt(raw));
    }
    return new JFloat(Number(raw), raw);
  };

  const parseValue = (depth: number): JValue => {
    skip();
    if (i >= n) fail('expecting a value');
    const c = text[i]!;
    if (c === '{' || c === '[') {
      if (depth >= MAX_DEPTH) fail(`nested deeper than ${MAX_DEPTH}`);
      i++;
      if (c === '[') {
        const arr: JValue[] = [];
        skip();
        if (text[i] === ']') {
          i++;
          return arr;
        }
        for (;;) {
          arr.push(parseValue(depth + 1));
          skip();
          if (text[i] === ',') {
            i++;
            continue;
          }
          if (text[i] === ']') {
            i++;
            return arr;
          }
          fail("expecting ',' or ']'");
        }
      }
      const map = new Map<string, JValue>();
      const dups: string[] = [];
      skip();
      if (text[i] === '}') {
        i++;
        return new JObject(map);
      }
      for (;;) {
        skip();
        if (text[i] !== '"') fail('expecting a property name in double quotes');
        const key = parseString();
        skip();
        if (text[i] !== ':') fail("expecting ':'");
        i++;
        const value = parseValue(depth + 1);
        if (map.has(key)) dups.push(key);
        map.set(key, value);
        skip();
        if (text[i] === ',') {
          i++;
          continue;
        }
        if (text[i] === '}') {
          i++;
          break;
        }
        fail("expecting ',' or '}'");
      }
      if (dups.length > 0) {
        throw new JsonError(`duplicate keys in ${pyRepr([...new Set(dups)])}`, 'duplicate');
      }
      return new JObject(map);
    }
    if (c === '"') return parseString();
    if (text.startsWith('true', i)) {
      i += 4;
      return true;
    }
    if (text.startsWith('false', i)) {
      i += 5;
      return false;
    }
    if (text.startsWith('null', i)) {
      i += 4;
      return null;
    }
    for (const constant of ['NaN', 'Infinity', '-Infinity']) {
      if (text.startsWith(constant, i)) throw new JsonError(`${constant} is not valid here`, 'constant');
    }
    if (c === '-' || (c >= '0' && c <= '9')) return parseNumber();
    return fail('expecting a value');
  };

  const value = parseValue(0);
  skip();
  if (i !== n) fail('extra data');
  return value;
}

/** The longest run of number characters from `at` (the regex then takes the valid prefix of it). */
function sliceNumber(text: string, at: number): string {
  let j = at;
  for (; j < text.length; j++) {
    const c = text.charCodeAt(j);
    // 0-9 . + - e E
    if (!((c >= 0x30 && c <= 0x39) || c === 0x2e || c === 0x2b || c === 0x2d || c === 0x65 || c === 0x45)) break;
  }
  return text.slice(at, j);
}

// ------------------------------------------------------------------------------------------------ writing

function escapeAscii(s: string): string {
  let out = '"';
  for (let i = 0; i < s.length; i++) {
    const u = s.charCodeAt(i);
    if (u === 0x22) out += '\\"';
    else if (u === 0x5c) out += '\\\\';
    else if (u === 0x0a) out += '\\n';
    else if (u === 0x0d) out += '\\r';
    else if (u === 0x09) out += '\\t';
    else if (u === 0x08) out += '\\b';
    else if (u === 0x0c) out += '\\f';
    else if (u < 0x20 || u > 0x7e) out += '\\u' + u.toString(16).padStart(4, '0');
    else out += s[i];
  }
  return out + '"';
}

/** A value {@link dumps} can write: strings, safe integers (as `number` or `bigint`), arrays and plain objects. */
export type Dumpable = string | number | bigint | Dumpable[] | { [key: string]: Dumpable };

/**
 * `json.dumps(value, separators=(",", ":"))` of Python, for the values a header holds (docs/codec.md 2.2):
 * no whitespace, integers in plain decimal, strings escaped to pure ASCII, object members in insertion order.
 */
export function dumps(value: Dumpable): string {
  if (typeof value === 'string') return escapeAscii(value);
  if (typeof value === 'bigint') return value.toString();
  if (typeof value === 'number') {
    if (!Number.isSafeInteger(value)) throw new RangeError(`dumps writes integers only, not ${value}`);
    return Object.is(value, -0) ? '0' : String(value);
  }
  if (Array.isArray(value)) return '[' + value.map(dumps).join(',') + ']';
  return '{' + Object.entries(value).map(([k, v]) => escapeAscii(k) + ':' + dumps(v)).join(',') + '}';
}

// ------------------------------------------------------------------------------------------------ repr

function reprString(s: string): string {
  const quote = s.includes("'") && !s.includes('"') ? '"' : "'";
  let out = quote;
  for (let i = 0; i < s.length; i++) {
    const ch = s[i]!;
    const u = s.charCodeAt(i);
    if (ch === quote || ch === '\\') out += '\\' + ch;
    else if (ch === '\n') out += '\\n';
    else if (ch === '\r') out += '\\r';
    else if (ch === '\t') out += '\\t';
    else if (u < 0x20 || (u >= 0x7f && u <= 0xa0)) out += '\\x' + u.toString(16).padStart(2, '0');
    else if (u >= 0xd800 && u <= 0xdfff) {
      const v = s.charCodeAt(i + 1);
      if (u <= 0xdbff && v >= 0xdc00 && v <= 0xdfff) {
        out += s.slice(i, i + 2);
        i++;
      } else out += '\\u' + u.toString(16).padStart(4, '0');
    } else out += ch;
  }
  return out + quote;
}

/** Python's `repr` of a float (shortest round-trip digits; fixed notation for exponents -4 ... 15). */
export function reprFloat(x: number): string {
  if (Number.isNaN(x)) return 'nan';
  if (!Number.isFinite(x)) return x > 0 ? 'inf' : '-inf';
  if (x === 0) return Object.is(x, -0) ? '-0.0' : '0.0';
  const [mant, expText] = x.toExponential().split('e') as [string, string];
  const exp = Number(expText);
  const neg = mant.startsWith('-');
  const digits = mant.replace('-', '').replace('.', '');
  let body: string;
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      const intPart = digits.slice(0, exp + 1).padEnd(exp + 1, '0');
      const frac = digits.slice(exp + 1);
      body = intPart + '.' + (frac === '' ? '0' : frac);
    } else {
      body = '0.' + '0'.repeat(-exp - 1) + digits;
    }
  } else {
    const m = digits.length > 1 ? digits[0] + '.' + digits.slice(1) : digits;
    body = m + 'e' + (exp < 0 ? '-' : '+') + String(Math.abs(exp)).padStart(2, '0');
  }
  return (neg ? '-' : '') + body;
}

/** Python's `repr` of a parsed JSON value (or of plain JS strings, numbers and arrays of them). */
export function pyRepr(v: JValue | number | bigint | readonly (JValue | number | bigint)[]): string {
  if (v === null) return 'None';
  if (v === true) return 'True';
  if (v === false) return 'False';
  if (typeof v === 'string') return reprString(v);
  if (typeof v === 'bigint') return v.toString();
  if (typeof v === 'number') return Number.isInteger(v) ? String(v) : reprFloat(v);
  if (v instanceof JInt) return v.value.toString();
  if (v instanceof JFloat) return reprFloat(v.value);
  if (v instanceof JObject) {
    return '{' + [...v.entries].map(([k, x]) => reprString(k) + ': ' + pyRepr(x)).join(', ') + '}';
  }
  return '[' + (v as readonly (JValue | number | bigint)[]).map((x) => pyRepr(x)).join(', ') + ']';
}
