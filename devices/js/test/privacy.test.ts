/**
 * The central mode's clip against pfl-edge's own `pfl_edge.privacy.privatize` (test/fixtures/privacy.json,
 * written by test/fixtures/make_fixtures.py): within the bound the update is sent as trained; past it, clipped to
 * the float32 bits pfl-edge sends.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { privatize } from '../src/privacy.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const fixtures = JSON.parse(readFileSync(FIX + 'privacy.json', 'utf8'));

const weights = (m: Record<string, number[]>): Map<string, Float32Array> =>
  new Map(Object.entries(m).map(([k, v]) => [k, new Float32Array(Uint32Array.from(v).buffer)]));

test('the clip equals pfl-edge\'s', () => {
  let clipped = 0;
  for (const c of fixtures.cases) {
    const state = weights(c.state);
    const sent = privatize(state, weights(c.base), Object.keys(c.base), c.clip);
    for (const [k, want] of Object.entries(c.sent as Record<string, number[]>)) {
      const got = Array.from(new Uint32Array(sent.get(k)!.buffer));
      const off = got.filter((v, i) => Math.abs(v - want[i]!) > 1).length; // at most 1 ulp: another summation order
      assert.equal(off, 0, `clip ${c.clip} tensor ${k}`);
    }
    if (sent !== state) clipped++;
  }
  assert.equal(clipped, 2); // the small update went as trained, the two large ones clipped
});
