/**
 * A device's own labelled images from a folder, as the Python device reads `pfl-edge client --data-dir DIR`
 * (`pfl_edge/data/folder.py`): `DIR/<class>/<image>`, one sub-folder per class (named `0` .. `C-1`, else
 * classes by sorted folder name), files whose suffix is one the Python device reads (`.png`, `.pgm`, `.ppm`,
 * `.jpg`, ...; any case) taken in sorted order and decoded by content (./../imagefiles.ts: PNG, PGM, PPM; any
 * other format refused naming the file). Node only (`node:fs`, `node:zlib`).
 */
import { readFileSync, readdirSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { inflateSync } from 'node:zlib';

import { decodeImageFile } from '../imagefiles.js';
import { IMAGE_SUFFIXES, ImageDataError, type OwnImageData, type OwnImageOptions, classFolders, comparePaths, isImageName,
  modelPixels, ownDataFromPixels } from '../images.js';

const inflate = (b: Uint8Array): Uint8Array => new Uint8Array(inflateSync(b));

const isDir = (p: string): boolean => {
  try {
    return statSync(p).isDirectory();
  } catch {
    return false;
  }
};

/** The model pixels and labels of a folder's images, in the Python device's order. */
export function readImageFolder(root: string, channels: number, height: number, width: number,
  numClasses: number): { pixels: Uint8Array[]; labels: number[]; files: string[] } {
  if (!isDir(root)) throw new ImageDataError(`--data-dir ${root} is not a folder of class folders`);
  const folders = readdirSync(root).filter((n) => isDir(join(root, n)));
  const pixels: Uint8Array[] = [];
  const labels: number[] = [];
  const files: string[] = [];
  for (const { name, label } of classFolders(folders, numClasses, root)) {
    const dir = join(root, name);
    for (const f of readdirSync(dir).sort(comparePaths)) {
      if (!isImageName(f)) continue;
      const path = join(dir, f);
      let bytes: Uint8Array;
      try {
        bytes = readFileSync(path);
      } catch (e) {
        throw new ImageDataError(`cannot read image ${path}: ${(e as Error).message}`);
      }
      pixels.push(modelPixels(decodeImageFile(bytes, path, inflate, label), channels, height, width));
      labels.push(label);
      files.push(path);
    }
  }
  if (pixels.length === 0) throw new ImageDataError(`${root}: no images (${IMAGE_SUFFIXES.join(', ')}) in its class folders`);
  return { pixels, labels, files };
}

/** The device's training and test samples from its own images in `root` (`load_image_folder`). */
export function loadImageFolder(root: string, o: OwnImageOptions): OwnImageData {
  const { pixels, labels } = readImageFolder(root, o.channels, o.height, o.width, o.numClasses);
  try {
    return ownDataFromPixels(pixels, labels, o);
  } catch (e) {
    if (e instanceof ImageDataError) throw new ImageDataError(`${root}: ${e.message}`);
    throw e;
  }
}
