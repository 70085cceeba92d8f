/**
 * The device's own images (`--data-dir`, partition "device") against the Python device's numbers
 * (test/fixtures/images.json and test/fixtures/images/, written by test/fixtures/make_image_fixtures.py with
 * edge_runtime.data.load_image_folder and Pillow): Pillow's grey conversion bit for bit, every file of two
 * folders (PNG of every colour type and bit depth it reads, PGM, PPM) decoded to the same model pixels, and the
 * standardised, held-out train and test arrays equal to the last bit; then the refusals (another size included:
 * this device does not resize).
 */
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { deflateSync, inflateSync } from 'node:zlib';

import { decodeImageFile } from '../src/imagefiles.js';
import { type DecodedImage, ImageDataError, classFolders, comparePaths, convertImage, isImageName, ownImageData,
  pyRound } from '../src/images.js';
import { nodeSha256 } from '../src/node.js';
import { loadImageFolder, readImageFolder } from '../src/nodejs/images.js';
import { toHex } from '../src/sha256.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const doc = JSON.parse(readFileSync(FIX + 'images.json', 'utf8'));
const SHAPES: Record<string, [number, number, number]> = { 'fashion-mnist': [1, 28, 28], cifar10: [3, 32, 32] };
const inflate = (b: Uint8Array): Uint8Array => new Uint8Array(inflateSync(b));
const hex = (a: ArrayBufferView): string => toHex(nodeSha256(new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));

/** make_image_fixtures.pattern: [h, w, bands] interleaved. */
function pattern(w: number, h: number, bands: number, salt: number): Uint8Array {
  const out = new Uint8Array(w * h * bands);
  for (let y = 0; y < h; y++) {
    for (let x = 0; x < w; x++) {
      for (let c = 0; c < bands; c++) {
        out[(y * w + x) * bands + c] = (x * x * 7 + y * 31 + x * y * 3 + c * 89 + salt * 17 + (Math.floor(x / 3) ^ Math.floor(y / 5)) * 40) & 255;
      }
    }
  }
  return out;
}

test("Pillow's convert('L'): ITU-R 601-2 luma in 16-bit fixed point", () => {
  for (const [r, g, b, l] of doc.luma.cases as number[][]) {
    const px = convertImage({ label: 0, width: 1, height: 1, channels: 3, pixels: Uint8Array.of(r!, g!, b!) }, 1);
    assert.equal(px[0], l, `${r},${g},${b}`);
    const rgba = convertImage({ label: 0, width: 1, height: 1, channels: 4, pixels: Uint8Array.of(r!, g!, b!, 17) }, 1);
    assert.equal(rgba[0], l, 'alpha is dropped, not composited');
  }
  // grey to RGB repeats; grey + alpha drops the alpha
  assert.deepEqual([...convertImage({ label: 0, width: 1, height: 1, channels: 2, pixels: Uint8Array.of(9, 200) }, 3)], [9, 9, 9]);
});

for (const f of doc.folders) {
  const [C, H, W] = SHAPES[f.dataset]!;
  const root = join(FIX, 'images', f.folder);

  test(`folder ${f.folder} (${f.dataset}): every file decoded and converted as Pillow does, in its order`, () => {
    const { pixels, files } = readImageFolder(root, C, H, W, 10);
    assert.deepEqual(files.map((p) => p.slice(root.length + 1)), f.files.map((x: { file: string }) => x.file));
    pixels.forEach((p, i) => assert.equal(hex(p), f.files[i].pixels_sha256, f.files[i].file));
  });

  test(`folder ${f.folder} (${f.dataset}): the train and test arrays of load_image_folder, to the last bit`, () => {
    for (const r of f.runs) {
      const d = loadImageFolder(root, { channels: C, height: H, width: W, numClasses: 10, sha256: nodeSha256, seed: r.seed, slot: r.slot });
      const what = `seed ${r.seed} slot ${r.slot}`;
      assert.deepEqual([...d.train.y], r.train_y, what);
      assert.deepEqual([...d.test.y], r.test_y, what);
      assert.deepEqual([...d.train.x.subarray(0, 8)], r.train_x_head.map(Math.fround), what);
      assert.equal(hex(d.train.x), r.train_x_sha256, what);
      assert.equal(hex(d.test.x), r.test_x_sha256, what);
      assert.equal(d.train.sampleSize, C * H * W);
      assert.equal(d.train.n + d.test.n, f.files.length);
      // a phone's way: its own decoded pixels through the platform-neutral core give the same arrays
      const classes = classFolders(['0', '1', '3', 'cat', 'dog', 'ant'].filter((n) => f.files.some((x: { file: string }) => x.file.startsWith(n + '/'))), 10);
      const images = f.files.map((x: { file: string }) => {
        const label = classes.find((c) => x.file.startsWith(c.name + '/'))!.label;
        return decodeImageFile(readFileSync(join(root, x.file)), x.file, inflate, label);
      });
      const core = ownImageData(images, { channels: C, height: H, width: W, numClasses: 10, sha256: nodeSha256, seed: r.seed, slot: r.slot });
      assert.equal(hex(core.train.x), r.train_x_sha256, what);
      assert.equal(hex(core.test.x), r.test_x_sha256, what);
    }
  });
}

test('class folders: numbers name their classes, else the sorted names count', () => {
  assert.deepEqual(classFolders(['3', '0', '10'], 11), [{ name: '0', label: 0 }, { name: '10', label: 10 }, { name: '3', label: 3 }]);
  assert.deepEqual(classFolders(['dog', 'cat', '7'], 10).map((c) => [c.name, c.label]), [['7', 0], ['cat', 1], ['dog', 2]]);
  assert.throws(() => classFolders(['0', '12'], 10, '/d'), /\/d: 2 classes \(largest label 12\) but the federation's model has 10/);
  assert.throws(() => classFolders([], 10, '/d'), /\/d has no class folders \(expected \/d\/<class>\/<image>\.png\)/);
  // Python's order is by code point: U+1F600 (a surrogate pair in UTF-16) sorts after U+FF5E
  assert.ok(comparePaths('\u{1F600}', '\uFF5E') > 0 && comparePaths('a', 'ab') < 0 && comparePaths('B', 'a') < 0);
  assert.ok(isImageName('x.PNG') && isImageName('a.b.jpeg') && !isImageName('.png') && !isImageName('x.png.txt') && !isImageName('png'));
  assert.deepEqual([0.5, 1.5, 2.5, 2.4, 2.6, 0.2 * 3].map(pyRound), [0, 2, 2, 2, 3, 1]);
});

// ------------------------------------------------------------------------------------------------ refusals

let crcTable: number[] | null = null;
function crc(b: Uint8Array): number {
  crcTable ??= Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  let c = 0xffffffff;
  for (const v of b) c = crcTable[(c ^ v) & 0xff]! ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/** A tiny PNG encoder: rows of raw bytes, filter 0 each. */
function png(w: number, h: number, colourType: number, depth: number, data: Uint8Array, interlace = 0): Uint8Array {
  const chunk = (type: string, body: Uint8Array): Uint8Array => {
    const out = new Uint8Array(12 + body.length);
    const v = new DataView(out.buffer);
    v.setUint32(0, body.length);
    for (let i = 0; i < 4; i++) out[4 + i] = type.charCodeAt(i);
    out.set(body, 8);
    v.setUint32(8 + body.length, crc(out.subarray(4, 8 + body.length)));
    return out;
  };
  const ihdr = new Uint8Array(13);
  const v = new DataView(ihdr.buffer);
  v.setUint32(0, w);
  v.setUint32(4, h);
  ihdr.set([depth, colourType, 0, 0, interlace], 8);
  const stride = data.length / h;
  const raw = new Uint8Array(h * (stride + 1));
  for (let y = 0; y < h; y++) raw.set(data.subarray(y * stride, (y + 1) * stride), y * (stride + 1) + 1);
  const parts = [Uint8Array.of(137, 80, 78, 71, 13, 10, 26, 10), chunk('IHDR', ihdr), chunk('IDAT', new Uint8Array(deflateSync(raw))),
    chunk('IEND', new Uint8Array(0))];
  const out = new Uint8Array(parts.reduce((a, p) => a + p.length, 0));
  let o = 0;
  for (const p of parts) {
    out.set(p, o);
    o += p.length;
  }
  return out;
}

test('the tiny encoder round-trips through the decoder (RGB, 8 bits)', () => {
  const px = pattern(5, 4, 3, 1);
  const d = decodeImageFile(png(5, 4, 2, 8, px), 'x.png', inflate);
  assert.deepEqual([d.width, d.height, d.channels], [5, 4, 3]);
  assert.deepEqual([...d.pixels], [...px]);
});

test('refusals: each names the file or folder and says why', (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'pfl-images-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const opts = { channels: 1, height: 28, width: 28, numClasses: 10, sha256: nodeSha256, seed: 1, slot: 0 };
  const make = (files: Record<string, Uint8Array | string>): string => {
    const root = mkdtempSync(join(dir, 'case-'));
    for (const [p, body] of Object.entries(files)) {
      mkdirSync(join(root, p, '..'), { recursive: true });
      writeFileSync(join(root, p), body);
    }
    return root;
  };
  const grey = png(28, 28, 0, 8, pattern(28, 28, 1, 2));
  const refused = (root: string, re: RegExp): void => {
    assert.throws(() => loadImageFolder(root, opts), (e: unknown) => e instanceof ImageDataError && re.test((e as Error).message),
      `${root}: ${re}`);
  };

  refused(join(dir, 'missing'), /--data-dir .*missing is not a folder of class folders/);
  // images straight in the folder, no class folders
  let root = make({ 'a.png': grey });
  refused(root, /has no class folders \(expected .*\/<class>\/<image>\.png\)/);
  // a class the model does not have
  refused(make({ '0/a.png': grey, '10/b.png': grey }), /2 classes \(largest label 10\) but the federation's model has 10/);
  // class folders without images (other files are skipped by their suffix)
  refused(make({ '0/notes.txt': 'x', '1/.png': grey }), /no images \(\.bmp, \.gif, \.jpeg, \.jpg, \.pgm, \.png, \.ppm, \.webp\) in its class folders/);
  // formats it does not decode, read by their bytes whatever their name says
  root = make({ '0/a.png': grey, '0/photo.jpg': Uint8Array.of(0xff, 0xd8, 0xff, 0xe0, 0, 16, 74, 70, 73, 70) });
  refused(root, /cannot read image .*0\/photo\.jpg: JPEG is not read by this device .*convert the image to PNG/);
  refused(make({ '0/x.gif': new TextEncoder().encode('GIF89a....') }), /cannot read image .*x\.gif: GIF is not read/);
  refused(make({ '0/x.png': new TextEncoder().encode('hello') }), /cannot read image .*x\.png: not a PNG, PGM or PPM file/);
  refused(make({ '0/x.pgm': new TextEncoder().encode('P5 28 28 65535\n') }), /x\.pgm: a PGM\/PPM of maxval 65535 is not read/);
  refused(make({ '0/x.ppm': new TextEncoder().encode('P6 28 28 255\nabc') }), /x\.ppm: truncated PGM\/PPM image data/);
  refused(make({ '0/x.png': png(28, 28, 0, 8, pattern(28, 28, 1, 2), 1) }), /x\.png: an interlaced \(Adam7\) PNG is not read/);
  refused(make({ '0/x.png': png(4, 4, 0, 16, pattern(8, 4, 1, 2)) }), /x\.png: a 16-bit PNG is not read/);
  const broken = grey.slice();
  broken[45] = broken[45]! ^ 1; // inside IDAT: its CRC no longer matches
  refused(make({ '0/x.png': broken }), /x\.png: broken PNG file \(CRC of chunk IDAT\)/);
  refused(make({ '0/x.png': grey.subarray(0, 50) }), /x\.png: truncated PNG file/);
  // another size than the model's: not resized, refused naming the file
  refused(make({ '0/a.png': grey, '0/b.png': png(27, 28, 0, 8, pattern(27, 28, 1, 2)) }),
    /b\.png is 27 x 28 pixels; the model takes 28 x 28 \(W x H\): resize it first/);
  // a folder named like an image
  mkdirSync(join(root = make({ '0/a.png': grey }), '0', 'dir.png'));
  refused(root, /cannot read image .*dir\.png/);

  // every image held out: nothing to train on
  const one: DecodedImage = { label: 0, width: 28, height: 28, channels: 1, pixels: pattern(28, 28, 1, 3) };
  assert.throws(() => ownImageData([one], { ...opts, testFraction: 1 }), /no training images left after holding out 100% for testing/);
  // the core's own checks
  assert.throws(() => ownImageData([{ ...one, pixels: one.pixels.subarray(1) }], opts), /783 bytes of pixels for 28 x 28 x 1/);
  assert.throws(() => ownImageData([{ ...one, label: 10 }], opts), /label 10 is not a class/);
  assert.throws(() => ownImageData([], opts), /no images/);
  // one image: nothing held out (round(0.2) = 0), standardised without Bessel's correction
  const d = ownImageData([one], opts);
  assert.deepEqual([d.train.n, d.test.n], [1, 0]);
});
