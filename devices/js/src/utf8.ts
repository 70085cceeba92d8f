/**
 * Strict UTF-8 decoding, written out so that it behaves the same on Node and on a phone (Hermes has no
 * `TextDecoder` with `fatal: true` on every version): overlong forms, encoded surrogates (U+D800 ... U+DFFF),
 * code points above U+10FFFF and truncated sequences are refused, as Python's `bytes.decode("utf-8")` refuses them.
 */

export class Utf8Error extends Error {
  constructor(readonly at: number) {
    super(`invalid UTF-8 at byte ${at}`);
    this.name = 'Utf8Error';
  }
}

/** Decodes `bytes` (all of it) to a JS string; throws {@link Utf8Error} at the first invalid byte. */
export function decodeUtf8(bytes: Uint8Array): string {
  const parts: string[] = [];
  let units: number[] = [];
  const n = bytes.length;
  let i = 0;
  while (i < n) {
    const b0 = bytes[i]!;
    let cp: number;
    if (b0 < 0x80) {
      cp = b0;
      i += 1;
    } else {
      let need: number;
      let min: number;
      if (b0 >= 0xc2 && b0 <= 0xdf) {
        need = 1;
        cp = b0 & 0x1f;
        min = 0x80;
      } else if (b0 >= 0xe0 && b0 <= 0xef) {
        need = 2;
        cp = b0 & 0x0f;
        min = 0x800;
      } else if (b0 >= 0xf0 && b0 <= 0xf4) {
        need = 3;
        cp = b0 & 0x07;
        min = 0x10000;
      } else {
        throw new Utf8Error(i); // 0x80..0xC1 (continuation or overlong lead) and 0xF5..0xFF
      }
      if (i + need >= n) throw new Utf8Error(i); // truncated at the end
      for (let j = 1; j <= need; j++) {
        const b = bytes[i + j]!;
        if ((b & 0xc0) !== 0x80) throw new Utf8Error(i);
        cp = (cp << 6) | (b & 0x3f);
      }
      if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) throw new Utf8Error(i);
      i += need + 1;
    }
    if (cp < 0x10000) {
      units.push(cp);
    } else {
      const v = cp - 0x10000;
      units.push(0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
    }
    if (units.length >= 8192) {
      parts.push(String.fromCharCode(...units));
      units = [];
    }
  }
  parts.push(String.fromCharCode(...units));
  return parts.join('');
}

/** The number of Unicode code points of a JS string, a lone surrogate counting as one (as Python's `len`). */
export function codePointLength(s: string): number {
  let count = 0;
  for (let i = 0; i < s.length; i++) {
    const u = s.charCodeAt(i);
    if (u >= 0xd800 && u <= 0xdbff && i + 1 < s.length) {
      const v = s.charCodeAt(i + 1);
      if (v >= 0xdc00 && v <= 0xdfff) i++;
    }
    count++;
  }
  return count;
}
