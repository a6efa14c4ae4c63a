#!/usr/bin/env node
// NodeTagger: an agentmw v1 middleware written in Node.js from protos/agentmw/v1/*.proto alone.
//
//   on_system_prompt : appends "\n[tagged by node]" to the prompt (declared cacheable).
//   on_reply         : intercepts only ReplyStartEvent, re-emits it followed by CustomEvent
//                      "node_hello" {"lang": "node"}; observes text deltas (copies, never waited
//                      for); everything else BYPASS. Counts the session's replies and the text
//                      deltas it saw in its own slot: {"replies": n, "deltas": m}.
//
// Usage: node server.js [HOST:PORT | --address HOST:PORT]   (port 0 = any free port)
'use strict';

const crypto = require('node:crypto');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const KEY = 'NodeTagger';
const TAG = '\n[tagged by node]';
const CREDITS = 32;
// AGENTMW_DEBUG=1 logs every message of every stream to stderr (as JSON).
const DEBUG = Boolean(process.env.AGENTMW_DEBUG);
let streamCount = 0;

// -- loading the protos at runtime -------------------------------------------------------------

const PROTO_ROOT = path.resolve(__dirname, '../../../protos');
const packageDefinition = protoLoader.loadSync(
  ['agentmw/v1/hooks.proto', 'agentmw/v1/types.proto', 'agentmw/v1/events.proto'],
  {
    includeDirs: [PROTO_ROOT], // google/protobuf/struct.proto ships with protobufjs
    keepCase: true, // field names exactly as in the .proto (snake_case)
    enums: String, // enums as their names, e.g. "HOOK_ON_REPLY"
    longs: Number, // uint64 seq / state_version as plain numbers
    defaults: false, // unset fields stay undefined (so "absent" is observable)
    oneofs: true, // each decoded oneof gets a virtual field naming its set member
  },
);
const v1 = grpc.loadPackageDefinition(packageDefinition).agentmw.v1;

// -- google.protobuf.Value / Struct <-> plain JSON ---------------------------------------------
// proto-loader has no JSON mapping for the well-known types: a Struct arrives as
// {fields: {k: Value}}, a Value as {kind: '<member>', <member>: ...}. CAREFUL: the bundled
// google/protobuf/struct.proto of protobufjs names its fields in camelCase (stringValue, ...)
// even with keepCase: true, unlike every agentmw message (snake_case). Wrong case = silent null.

function fromValue(v) {
  if (v == null) return null;
  switch (v.kind) {
    case 'numberValue':
      return v.numberValue;
    case 'stringValue':
      return v.stringValue;
    case 'boolValue':
      return v.boolValue;
    case 'structValue':
      return fromStruct(v.structValue);
    case 'listValue':
      return (v.listValue.values || []).map(fromValue);
    default:
      return null; // nullValue, or a Value with no kind set
  }
}

function fromStruct(s) {
  const out = {};
  for (const [k, v] of Object.entries((s && s.fields) || {})) out[k] = fromValue(v);
  return out;
}

function toValue(x) {
  if (x === null || x === undefined) return { nullValue: 'NULL_VALUE' };
  if (typeof x === 'number') return { numberValue: x };
  if (typeof x === 'string') return { stringValue: x };
  if (typeof x === 'boolean') return { boolValue: x };
  if (Array.isArray(x)) return { listValue: { values: x.map(toValue) } };
  return { structValue: toStruct(x) };
}

function toStruct(obj) {
  const fields = {};
  for (const [k, v] of Object.entries(obj)) fields[k] = toValue(v);
  return { fields };
}

// The class name of a thrown value: a subclass of Error that does not set `name` still has its own.
function errorType(err) {
  if (!(err instanceof Error)) return 'Error'; // a thrown string or object: no class of its own
  return err.name && err.name !== 'Error' ? err.name : err.constructor.name;
}

// -- one bidirectional stream = a sequence of invocations --------------------------------------

// Runs `handler` for every invocation on a stream. STREAMS ARE REUSED: after finish/fail the host
// may send another `begin` on the same stream, so this loops until the host half-closes it.
// INVOCATION IDS: every host message names its invocation (`invocation`, set on the begin); we
// echo it on everything we send, and ignore host messages of any other invocation (copies already
// in flight when we finished) and anything between a finish/fail and the next begin.
function serveStream(call, hookName, handler) {
  let inv = null; // the current invocation, or null between finish/fail and the next begin
  const id = ++streamCount;
  const log = (dir, msg) => DEBUG && console.error(`[${hookName} #${id}] ${dir} ${JSON.stringify(msg)}`);

  const send = (msg) => {
    msg.invocation = inv.id; // required on every message: the host drops or refuses others
    log('->', msg);
    call.write(msg);
  };

  function done(msg) {
    send(msg);
    inv = null; // anything until the next begin is ignored
  }

  function dispatch(msg) {
    const which = msg.message;
    if (which === 'batch') {
      // Several host messages in one: handle them in order as if sent one by one.
      for (const m of msg.batch.messages || []) dispatch(m);
      return;
    }
    if (which === 'begin') {
      // Every invocation starts fresh: nothing carries over from the previous one.
      inv = { id: msg.invocation, begin: msg.begin, inner: 0, context: msg.begin.context };
      step(() => handler.begin(inv, msg.begin));
      return;
    }
    if (inv === null || msg.invocation !== inv.id) return; // late message of a finished invocation
    const body = msg[which];
    // Messages may carry a refreshed context (only when host state changed).
    if (body && body.context) inv.context = body.context;
    // After a second call_next, messages still in flight from the first pipeline are ignored.
    if (body && body.inner !== undefined && body.inner !== inv.inner) return;
    // `interrupted` (hooks.proto) comes only to hooks that declare interrupt_notice, which this
    // server does not; once a reply is interrupted, every context it gets says `interrupted: true`.
    if (which === 'item') step(() => handler.item(inv, msg.item));
    else if (which === 'inner_done') step(() => handler.innerDone(inv, msg.inner_done));
    else if (which === 'inner_error') step(() => handler.innerError(inv, msg.inner_error));
  }

  // Turns the handler's returned MiddlewareMessage into a write; a thrown error becomes `fail`.
  function step(fn) {
    let out;
    try {
      out = fn();
    } catch (err) {
      // Whatever was thrown is answered (hooks.proto, Fail): `type` names its class, as the host
      // reports it ("QuotaError: ..."), `message` its text.
      done({ fail: { type: errorType(err), message: String((err && err.message) || err) } });
      return;
    }
    if (!out) return;
    if (out.finish || out.fail) done(out);
    else {
      if (out.call_next) inv.inner += 1; // items of this pipeline carry inner = this number
      send(out);
    }
  }

  call.on('data', (msg) => {
    log('<-', msg);
    try {
      dispatch(msg);
    } catch (err) {
      console.error(`${KEY} ${hookName}: ${err && err.stack ? err.stack : err}`);
    }
  });
  call.on('end', () => call.end()); // the host half-closed: no more invocations
  call.on('error', () => {}); // cancelled / broken stream: nothing to clean up
}

// -- the hooks -----------------------------------------------------------------------------------

// on_system_prompt is a transformer: no inner pipeline, just finish with the new prompt.
const onSystemPrompt = {
  begin(inv, begin) {
    const kwargs = (begin.input_kwargs && begin.input_kwargs.on_system_prompt) || {};
    return { finish: { result: { prompt: (kwargs.prompt || '') + TAG } } };
  },
  item() {},
  innerDone() {},
  innerError() {},
};

function customEvent(name, value) {
  // Ids and timestamps are opaque strings that either side may mint.
  return {
    custom: {
      id: crypto.randomUUID(),
      created_at: new Date().toISOString(),
      name,
      value: toStruct(value),
    },
  };
}

const onReply = {
  begin(inv, begin) {
    // Our slot (agent.state.middle_context["NodeTagger"]) as of this call; null when unset. Only
    // this middleware writes it, so the begin's value is still current at ReplyStartEvent.
    const slot = fromValue(begin.context && begin.context.slot) || {};
    inv.slot = { replies: Number(slot.replies) || 0, deltas: Number(slot.deltas) || 0 };
    inv.credits = CREDITS; // observed copies the host may still send before it waits for a pull
    inv.answered = 0; // seq of the last intercepted item we answered (Pull.answers_seq)
    return { call_next: { credits: CREDITS } }; // no overrides: the kwargs unchanged
  },
  item(inv, delivery) {
    if (delivery.observed) {
      // A copy, already forwarded by the host: no answer. Each uses one credit; refill as the
      // grant runs out. That pull may cross an intercepted item or inner_done on the wire:
      // answers_seq (the last item we answered, not the one the host may hold now) makes it a
      // credit grant only, and a pull after inner_done is ignored (hooks.proto, pull).
      if (delivery.item && delivery.item.item === 'text_block_delta') inv.slot.deltas += 1;
      inv.credits -= 1;
      if (inv.credits > 0) return null;
      inv.credits += CREDITS;
      return { pull: { credits: CREDITS, answers_seq: inv.answered } };
    }
    // Intercepted (lock-step): the item is dropped unless we emit it; forward_seq re-emits it
    // without resending, and must name its seq. Actions apply in order.
    const actions = [{ emit: { forward_seq: delivery.seq } }];
    if (delivery.item && delivery.item.item === 'reply_start') {
      actions.push({ emit: { item: customEvent('node_hello', { lang: 'node' }) } });
      // Count at ReplyStartEvent, not at begin: a parked reply resumed later (after a user
      // confirmation) calls on_reply again but emits no new ReplyStartEvent. The host applies the
      // mutation before it resumes the inner pipeline.
      inv.slot.replies += 1;
      actions.push({ mutate: { set_slot: toValue(inv.slot) } });
    }
    // The answer to this item: answers_seq names it. Delivering it ended the current grant.
    inv.answered = delivery.seq;
    inv.credits = CREDITS;
    return { actions, pull: { credits: CREDITS, answers_seq: delivery.seq } };
  },
  innerDone(inv) {
    // on_reply's output was emitted: no result. The deltas counted go with the finish.
    return { actions: [{ mutate: { set_slot: toValue(inv.slot) } }], finish: {} };
  },
  innerError(inv, err) {
    // Let the inner pipeline's exception escape unchanged.
    return { fail: { type: err.type, message: err.message, from_inner: true } };
  },
};

// -- Describe ------------------------------------------------------------------------------------

const DESCRIPTION = {
  key: KEY,
  protocol_version: 'v1',
  hooks: [
    // cacheable: the new prompt is the input prompt plus a fixed tag, so the host may reuse it for
    // the same input (and slot) in any later step, reply or session, until it describes us again.
    { hook: 'HOOK_ON_SYSTEM_PROMPT', cacheable: true },
    {
      // Not done_with_inner: it observes deltas, and its finish carries the slot with their count.
      // Not only_when either: it counts every reply (only_when suits a hook idle until a flag is set).
      hook: 'HOOK_ON_REPLY',
      default_mode: 'SUBSCRIPTION_MODE_BYPASS', // UNSPECIFIED would mean INTERCEPT
      subscriptions: [
        { item_type: 'ITEM_TYPE_REPLY_START', mode: 'SUBSCRIPTION_MODE_INTERCEPT' },
        { item_type: 'ITEM_TYPE_TEXT_BLOCK_DELTA', mode: 'SUBSCRIPTION_MODE_OBSERVE' },
      ],
    },
  ],
  provides_tools: false,
};

// -- main ----------------------------------------------------------------------------------------

function parseAddress(argv) {
  const i = argv.indexOf('--address');
  if (i >= 0 && argv[i + 1]) return argv[i + 1];
  const positional = argv.find((a) => !a.startsWith('--'));
  return positional || '127.0.0.1:0';
}

function main() {
  const address = parseAddress(process.argv.slice(2));
  const host = address.slice(0, address.lastIndexOf(':'));

  // Messages as large as the host sends (hooks.proto: up to 64 MiB; a Begin carries a session's
  // context), not grpc-js's default 4 MiB.
  const MAX_MESSAGE = 64 * 1024 * 1024;
  const server = new grpc.Server({
    'grpc.max_receive_message_length': MAX_MESSAGE,
    'grpc.max_send_message_length': MAX_MESSAGE,
  });
  server.addService(v1.Describe.service, {
    Describe: (call, callback) => callback(null, DESCRIPTION),
  });
  server.addService(v1.OnSystemPrompt.service, {
    Run: (call) => serveStream(call, 'on_system_prompt', onSystemPrompt),
  });
  server.addService(v1.OnReply.service, {
    Run: (call) => serveStream(call, 'on_reply', onReply),
  });

  server.bindAsync(address, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      console.error(`${KEY}: cannot listen on ${address}: ${err.message}`);
      process.exit(1);
    }
    process.stdout.write(`agentmw middleware ${KEY} listening on ${host}:${port}\n`);
  });

  const stop = () => {
    const force = setTimeout(() => {
      server.forceShutdown();
      process.exit(0);
    }, 2000);
    force.unref();
    server.tryShutdown(() => process.exit(0));
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main();
