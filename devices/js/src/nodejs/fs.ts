/** The state dir on Node's file system: atomic writes (temp file, fsync, rename, fsync of the dir), 0600 secrets. */
import { randomBytes } from 'node:crypto';
import { promises as fs } from 'node:fs';
import { dirname, join, resolve, sep } from 'node:path';

import type { Storage } from '../state.js';

export class DirStorage implements Storage {
  readonly root: string;

  constructor(root: string) {
    this.root = resolve(root);
  }

  private path(name: string): string {
    const p = resolve(this.root, name);
    if (!p.startsWith(this.root + sep)) throw new Error(`${name} is outside the state dir`);
    return p;
  }

  async read(name: string): Promise<Uint8Array | null> {
    try {
      return new Uint8Array(await fs.readFile(this.path(name)));
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ENOENT') return null;
      throw e;
    }
  }

  async write(name: string, data: Uint8Array, opts: { secret?: boolean } = {}): Promise<void> {
    const p = this.path(name);
    const dir = dirname(p);
    await fs.mkdir(dir, { recursive: true, mode: 0o700 });
    const tmp = join(dir, `.${randomBytes(6).toString('hex')}.tmp`);
    const fh = await fs.open(tmp, 'w', opts.secret ? 0o600 : 0o644);
    try {
      await fh.writeFile(data);
      await fh.sync();
    } finally {
      await fh.close();
    }
    try {
      await fs.rename(tmp, p);
    } catch (e) {
      await fs.rm(tmp, { force: true });
      throw e;
    }
    const d = await fs.open(dir, 'r');
    try {
      await d.sync();
    } catch {
      // some file systems cannot sync a directory
    } finally {
      await d.close();
    }
  }

  async remove(name: string): Promise<void> {
    await fs.rm(this.path(name), { force: true });
  }

  async append(name: string, line: string): Promise<void> {
    const p = this.path(name);
    await fs.mkdir(dirname(p), { recursive: true });
    await fs.appendFile(p, line.endsWith('\n') ? line : line + '\n');
  }
}
