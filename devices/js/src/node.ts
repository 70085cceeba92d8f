/**
 * What only Node has: SHA-256 from `node:crypto` (OpenSSL, several GB/s). A React Native build must not import
 * this file; it uses ./sha256.ts or its own native digest instead.
 */
import { createHash } from 'node:crypto';

import type { Sha256 } from './sha256.js';

export const nodeSha256: Sha256 = (data) => new Uint8Array(createHash('sha256').update(data).digest());
