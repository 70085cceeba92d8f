#!/usr/bin/env node
/**
 * A pfl-edge device in Node:
 *
 *   node dist/bin/device.js --server URL --federation F --enrol-secret S --profile phone-mid --state-dir DIR
 *     [--partition-id N] [--name NAME] [--threads N] [--dataset-dir DIR | --data-dir DIR] [--patience S] [--poll S] [-v]
 *
 * --data-dir DIR: the device's own labelled images, DIR/<class>/<image> (PNG, PGM, PPM), as `pfl-edge client
 * --data-dir`; a federation of `"partition": "device"` needs it.
 *
 * Exit codes: 0 the federation finished (or a signal stopped it), 2 a configuration error or a refusal it cannot
 * fix (wrong secret, full federation, a card it cannot run), 1 anything else.
 */
import { parseArgs } from 'node:util';

import { CardError } from '../src/card.js';
import { Device } from '../src/device.js';
import { EnrolRefused } from '../src/enrol.js';
import { HttpError, Unreachable } from '../src/http.js';
import { logger, nodePlatform } from '../src/nodejs/platform.js';
import { ImageDataError } from '../src/images.js';
import { DealError } from '../src/partition.js';

const USAGE = `usage: device --server URL --federation F --enrol-secret S --profile P --state-dir DIR
              [--partition-id N] [--name NAME] [--threads N] [--dataset-dir DIR | --data-dir DIR] [--patience S] [--poll S]
              [--ca-file FILE] [--max-blob-bytes N] [-v]`;

async function main(): Promise<number> {
  let values;
  try {
    ({ values } = parseArgs({
      options: {
        server: { type: 'string' },
        federation: { type: 'string' },
        'enrol-secret': { type: 'string' },
        profile: { type: 'string', default: 'phone-mid' },
        'state-dir': { type: 'string' },
        'partition-id': { type: 'string' },
        name: { type: 'string', default: '' },
        threads: { type: 'string', default: '1' },
        'dataset-dir': { type: 'string' },
        'data-dir': { type: 'string' },
        patience: { type: 'string', default: '300' },
        poll: { type: 'string', default: '10' },
        'ca-file': { type: 'string' },
        'max-blob-bytes': { type: 'string', default: String(256 * 1024 * 1024) },
        verbose: { type: 'boolean', short: 'v', default: false },
        help: { type: 'boolean', short: 'h', default: false },
      },
      strict: true,
    }));
  } catch (e) {
    console.error(`${(e as Error).message}\n${USAGE}`);
    return 2;
  }
  if (values.help) {
    console.log(USAGE);
    return 0;
  }
  const secret = values['enrol-secret'] ?? process.env['PFL_ENROL_SECRET'];
  if (!values.server || !values.federation || !values['state-dir'] || !secret) {
    console.error(`--server, --federation, --state-dir and --enrol-secret (or PFL_ENROL_SECRET) are needed\n${USAGE}`);
    return 2;
  }
  const int = (v: string | undefined, what: string): number => {
    const n = Number(v);
    if (!Number.isFinite(n) || n < 0) throw new Error(`${what} must be a non-negative number, got ${v}`);
    return n;
  };
  const name = values.name || `js-${values['partition-id'] ?? 'any'}`;
  const log = logger(values.verbose, name);
  const platform = nodePlatform({ stateDir: values['state-dir'], datasetDir: values['dataset-dir'] ?? null,
    imageDir: values['data-dir'] ?? null,
    caFile: values['ca-file'] ?? null, verbose: values.verbose, name });
  const device = new Device({
    server: values.server, federation: values.federation, enrolSecret: secret, profile: values.profile!, name,
    partitionId: values['partition-id'] === undefined ? null : int(values['partition-id'], '--partition-id'),
    threads: Math.max(1, int(values.threads, '--threads')), patienceS: int(values.patience, '--patience'),
    maxBlobBytes: int(values['max-blob-bytes'], '--max-blob-bytes'), pollS: int(values.poll, '--poll'), exitWhenDone: true,
  }, platform);
  for (const sig of ['SIGINT', 'SIGTERM'] as const) process.once(sig, () => { log('info', `${sig}: stopping`); device.stop(); });
  try {
    const code = await device.run();
    log('info', device.done ? 'the federation has finished; exiting' : 'stopped');
    return code;
  } catch (e) {
    const fatal = e instanceof EnrolRefused || e instanceof CardError || e instanceof DealError || e instanceof ImageDataError;
    if (fatal) log('error', (e as Error).message);
    else if (e instanceof HttpError || e instanceof Unreachable) log('error', (e as Error).message);
    else log('error', (e as Error).stack ?? String(e));
    return fatal ? 2 : 1;
  }
}

main().then((code) => process.exit(code), (e) => {
  console.error(e);
  process.exit(1);
});
