/** The codec's parts: binary16 rounding, SHA-256, the header's JSON, and codec.md's worked examples. */
import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { f16Bits, f16Value, f32Bits } from '../src/f16.js';
import { JFloat, JInt, JObject, JsonError, dumps, parse, pyRepr, reprFloat } from '../src/json.js';
import { nodeSha256 } from '../src/node.js';
import { sha256, toHex } from '../src/sha256.js';
import { codePointLength, decodeUtf8, Utf8Error } from '../src/utf8.js';

const DOCS = fileURLToPath(new URL('../../../../docs/', import.meta.url));

describe('binary16', () => {
  test('rounding to nearest, ties to even (the cases dense_f16 names)', () => {
    const cases: [number, number][] = [
      [1 / 3, 0x3555],
      [1 + 2 ** -11, 0x3c00], // a tie: to even
      [1 + 3 * 2 ** -11, 0x3c02], // a tie: to even (up)
      [2 ** -25 * (1 + 2 ** -20), 0x0001], // just above half the smallest subnormal
      [2 ** -25, 0x0000], // a tie: to even (zero)
      [-(2 ** -25), 0x8000],
      [2 ** -24, 0x0001],
      [1023 * 2 ** -24, 0x03ff],
      [2 ** -14, 0x0400],
      [2 ** -14 - 2 ** -25, 0x0400], // the largest subnormal plus half a unit: a tie, rounds up to the even normal
      [65504, 0x7bff],
      [65519.99, 0x7bff],
      [65520, 0x7c00], // rounds to Inf: the encoder refuses it
      [-65504, 0xfbff],
      [0.1, 0x2e66],
      [-0, 0x8000],
      [0, 0x0000],
      [1e-10, 0x0000],
      [2 ** -126, 0x0000],
      [1e10, 0x7c00],
    ];
    for (const [x, h] of cases) assert.equal(f16Bits(x), h, `f16(${x}) = ${f16Bits(x).toString(16)}, expected ${h.toString(16)}`);
  });

  test('widening is exact and every finite binary16 survives a round trip', () => {
    for (let h = 0; h < 0x10000; h++) {
      if ((h & 0x7c00) === 0x7c00) continue;
      const v = f16Value(h);
      assert.equal(Math.fround(v), v);
      assert.equal(f16Bits(v), h);
    }
    assert.equal(f32Bits(f16Value(0x2e66)), 0x3dccc000);
    assert.equal(f32Bits(f16Value(0x7bff)), 0x477fe000);
    assert.ok(Object.is(f16Value(0x8000), -0));
  });
});

describe('sha256', () => {
  test('the TypeScript digest equals node:crypto for every length around the block edges', () => {
    const buf = randomBytes(300);
    for (let n = 0; n <= 300; n++) {
      const d = buf.subarray(0, n);
      assert.equal(toHex(sha256(d)), createHash('sha256').update(d).digest('hex'), `length ${n}`);
    }
    const big = randomBytes(1 << 20);
    assert.deepEqual(sha256(big), nodeSha256(big));
    assert.equal(toHex(sha256(new TextEncoder().encode('abc'))), 'ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad');
  });
});

describe('utf8', () => {
  test('strict decoding', () => {
    const ok = (bytes: number[], s: string): void => assert.equal(decodeUtf8(Uint8Array.from(bytes)), s);
    const bad = (bytes: number[]): void => assert.throws(() => decodeUtf8(Uint8Array.from(bytes)), Utf8Error);
    ok([0x61, 0xc3, 0xa9], 'aé');
    ok([0xf0, 0x9f, 0x98, 0x80], '\u{1f600}');
    ok([0xef, 0xbb, 0xbf], '\ufeff');
    bad([0xff]);
    bad([0xc0, 0x80]); // overlong
    bad([0xe0, 0x80, 0x80]); // overlong
    bad([0xed, 0xa0, 0x80]); // a surrogate
    bad([0xf4, 0x90, 0x80, 0x80]); // above U+10FFFF
    bad([0xc3]); // truncated
    bad([0xe2, 0x82]); // truncated
    bad([0x80]); // a lone continuation byte
    assert.equal(codePointLength('a\u{1f600}\ud800'), 3);
  });
});

describe('header JSON', () => {
  test('integers are exact and apart from non-integers', () => {
    const v = parse('[3, 3.0, 3e0, -0, 123456789012345678901234567890, 1e400]') as unknown[];
    assert.ok(v[0] instanceof JInt && v[0].value === 3n);
    assert.ok(v[1] instanceof JFloat && v[1].value === 3 && v[1].raw === '3.0');
    assert.ok(v[2] instanceof JFloat);
    assert.ok(v[3] instanceof JInt && v[3].value === 0n);
    assert.ok(v[4] instanceof JInt && v[4].value === 123456789012345678901234567890n);
    assert.ok(v[5] instanceof JFloat && v[5].value === Infinity);
  });

  test('refusals', () => {
    const kind = (text: string): string => {
      try {
        parse(text);
      } catch (err) {
        assert.ok(err instanceof JsonError);
        return err.kind;
      }
      return 'accepted';
    };
    for (const text of ['{"a":1,"a":2}', '{"w":1,"\\u0077":2}', '[{"x":[{"y":1,"y":1}]}]']) assert.equal(kind(text), 'duplicate', text);
    for (const text of ['NaN', '[Infinity]', '{"r":-Infinity}']) assert.equal(kind(text), 'constant', text);
    const syntax = ['', ' ', '{', '[1,]', '{"a":1,}', '01', '1.', '.5', '+1', '1e', '"\u0001"', '"\\x"', '"\\u12"', "'a'",
      '[1] 2', '\ufeff{}', '\u00a0[]', 'nul', 'True', '{"a" 1}', '{1:2}', '[' .repeat(600) + ']'.repeat(600), '9'.repeat(4301)];
    for (const text of syntax) assert.equal(kind(text), 'syntax', JSON.stringify(text.slice(0, 20)));
    for (const text of [' \t\r\n{ "a" : [ 1 , 2 ] }\n', '"\\ud800"', '"\u007f\u00e9"', '9'.repeat(4300), '[[[[]]]]']) {
      assert.equal(kind(text), 'accepted', JSON.stringify(text.slice(0, 20)));
    }
    const o = parse('{"b":1,"a":2}');
    assert.ok(o instanceof JObject);
    assert.deepEqual([...o.entries.keys()], ['b', 'a']);
  });

  test('dumps writes what Python json.dumps(separators=(",", ":")) writes', () => {
    assert.equal(
      dumps({ model: 'cnn/10/1x28/deep0', round: 3, tensors: [['w', [2, 1], 'f4', 0, 8], ['b', [1], 'f4', 8, 4]] }),
      '{"model":"cnn/10/1x28/deep0","round":3,"tensors":[["w",[2,1],"f4",0,8],["b",[1],"f4",8,4]]}',
    );
    assert.equal(dumps('é\u{1f600}"\\/\b\f\n\r\t\u0000\u001f\u007f'), '"\\u00e9\\ud83d\\ude00\\"\\\\/\\b\\f\\n\\r\\t\\u0000\\u001f\\u007f"');
    assert.equal(dumps([]), '[]');
  });

  test('repr as Python writes it in messages', () => {
    assert.equal(pyRepr(['b', "it's", 7, null, true]), `['b', "it's", 7, None, True]`);
    assert.equal(reprFloat(3), '3.0');
    assert.equal(reprFloat(-0), '-0.0');
    assert.equal(reprFloat(1e16), '1e+16');
    assert.equal(reprFloat(1e-5), '1e-05');
    assert.equal(reprFloat(0.0001), '0.0001');
    assert.equal(reprFloat(123.456), '123.456');
    assert.equal(reprFloat(1.5e300), '1.5e+300');
    assert.equal(pyRepr(parse('3.0')), '3.0');
  });
});

test("codec.md's hex dumps of the worked examples are the vectors' bytes", () => {
  const doc = readFileSync(DOCS + 'codec.md', 'utf8');
  for (const letter of 'abcde') {
    const section = doc.split(`### (${letter})`)[1]!.split('```')[1]!;
    const rows = [...section.matchAll(/^([0-9a-f]{4}) {2}((?:[0-9a-f]{2} ){0,15}[0-9a-f]{2})/gm)];
    const payload = new Uint8Array(readFileSync(DOCS + `vectors/example_${letter}.bin`));
    assert.ok(rows.length > 0 && parseInt(rows.at(-1)![1]!, 16) + 16 >= payload.length);
    for (const [, offset, hexes] of rows) {
      const at = parseInt(offset!, 16);
      assert.equal(toHex(payload.subarray(at, at + 16)), hexes!.replaceAll(' ', ''), `example (${letter}) at ${offset}`);
    }
  }
});
