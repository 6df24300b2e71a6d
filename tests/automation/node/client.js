// An automation client in another language: stock @grpc/grpc-js and
// @grpc/proto-loader loading afe's own .proto file, nothing afe-specific
// besides the socket path, the key file and the metadata name (docs/AUTOMATION.md).
//
//   node client.js --run DIR --proto ROOT [--workspace demo --workflow demo-fix --title T]
//
// Creates a ticket, watches it (resuming from the next seq when a stream
// breaks) until it waits for approval, approves the head SHA it saw, then
// watches to the end. Prints one JSON line: {id, state, approved_sha, seqs}.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

function args() {
  const out = {workspace: 'demo', workflow: 'demo-fix', title: 'add() subtracts', principal: 'node-client'};
  const a = process.argv.slice(2);
  for (let i = 0; i < a.length; i += 2) out[a[i].replace(/^--/, '')] = a[i + 1];
  return out;
}

const opts = args();
const def = protoLoader.loadSync('afe/scheduler/v1/scheduler.proto',
  {includeDirs: [opts.proto], keepCase: true, longs: Number, enums: String, defaults: true});
const afe = grpc.loadPackageDefinition(def).afe.scheduler.v1;
const key = fs.readFileSync(path.join(opts.run, 'automation.key'), 'utf8').trim();
const md = new grpc.Metadata();
md.set('x-afe-link', key);
const client = new afe.Scheduler('unix://' + path.resolve(opts.run, 'scheduler.sock'),
  grpc.credentials.createInsecure());

const call = (method, req) => new Promise((resolve, reject) =>
  client[method](req, md, (err, res) => (err ? reject(err) : resolve(res))));

const seqs = [];
let nextSeq = 1;

// Follow the ticket from nextSeq until `stopAt` (an event type) or the end of
// the stream; a stream that breaks is resumed from the next seq.
function watch(id, stopAt) {
  return new Promise((resolve, reject) => {
    const stream = client.WatchTicket({id, from_seq: nextSeq, follow: true}, md);
    let done = false;
    stream.on('data', (ev) => {
      if (done) return;
      seqs.push(ev.seq);
      nextSeq = ev.seq + 1;
      if (ev.type === stopAt) {
        done = true;
        stream.cancel();
        resolve(ev);
      }
    });
    stream.on('end', () => { if (!done) { done = true; resolve(null); } });
    stream.on('error', (err) => {
      if (done) return;      // our own cancel
      done = true;
      if (err.code === grpc.status.UNAVAILABLE || err.code === grpc.status.RESOURCE_EXHAUSTED) {
        watch(id, stopAt).then(resolve, reject);
      } else {
        reject(err);
      }
    });
  });
}

async function main() {
  const t = await call('CreateTicket', {workspace: opts.workspace, workflow: opts.workflow, title: opts.title,
                                        body: 'make the tests pass', principal: opts.principal});
  const asked = await watch(t.id, 'approval.requested');
  if (!asked) throw new Error(`ticket ${t.id} ended without asking for approval`);
  const waiting = await call('GetTicket', {id: t.id});
  if (waiting.state !== 'TICKET_STATE_WAITING_APPROVAL') throw new Error(`ticket ${t.id} is ${waiting.state}`);
  const sha = waiting.awaiting_sha;
  await call('ApproveTicket', {id: t.id, principal: opts.principal, sha});
  await watch(t.id, 'ticket.finished');
  const final = await call('GetTicket', {id: t.id});
  process.stdout.write(JSON.stringify({id: t.id, state: final.state, approved_sha: sha,
                                       approval_sha: final.approval ? final.approval.sha : '',
                                       pr_state: final.pr ? final.pr.state : '', last_seq: final.last_seq,
                                       seqs}) + '\n');
  client.close();
}

main().catch((err) => {
  process.stderr.write(`node client failed: ${err.code !== undefined ? `${err.code} ` : ''}${err.details || err.message}\n`);
  client.close();
  process.exit(1);
});
