/**
 * @pfl-edge/device: the platform-neutral core (no Node API here, so a React Native app can import it).
 * Node-only helpers are in ./node.ts and ./nodejs/.
 */
export * from './codec.js';
export { sha256, toHex, type Sha256 } from './sha256.js';
export { f16Bits, f16BitsFromF32Bits, f16Value, f32Bits, f32FromBits } from './f16.js';
export * from './card.js';
export * from './data.js';
export * from './device.js';
export * as dispfl from './dispfl.js';
export * from './enrol.js';
export * from './http.js';
export * from './images.js';
export * from './imagefiles.js';
export * from './messages.js';
export * from './mqtt.js';
export * from './partition.js';
export * from './rng.js';
export * from './sgd.js';
export * from './share.js';
export * from './state.js';
export * from './train.js';
