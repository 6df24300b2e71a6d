// JSON-RPC 2.0 over the /rpc WebSocket. The session cookie authenticates the
// handshake (same origin only); nothing secret is ever held in JS.

export class RpcError extends Error {
  constructor(err) {
    super(err.message);
    this.code = err.code;
    this.name = (err.data && err.data.code) || "error";
  }
}

export class Rpc {
  constructor(onStatus) {
    this.onStatus = onStatus || (() => {});
    this.nextId = 1;
    this.pending = new Map();
    this.subs = new Map();
    this.ws = null;
    this.opening = null;
    this.onAuthLost = () => {};
  }

  open() {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) return Promise.resolve();
    if (this.opening) return this.opening;
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    this.opening = new Promise((resolve, reject) => {
      const ws = new WebSocket(`${scheme}//${location.host}/rpc`);
      let opened = false;
      ws.onopen = () => { opened = true; this.ws = ws; this.opening = null; this.onStatus("connected"); resolve(); };
      ws.onmessage = (ev) => this._message(ev.data);
      ws.onclose = (ev) => {
        this.ws = null;
        this.opening = null;
        for (const [, p] of this.pending) p.reject(new RpcError({ code: -1, message: "connection closed" }));
        this.pending.clear();
        for (const [, s] of this.subs) s.onEnd && s.onEnd({ message: "connection closed" });
        this.subs.clear();
        this.onStatus("disconnected");
        if (ev.code === 4401 || !opened) this.onAuthLost(ev.code);
        if (!opened) reject(new Error("could not open /rpc"));
      };
    });
    return this.opening;
  }

  _message(text) {
    let doc;
    try { doc = JSON.parse(text); } catch { return; }
    if (doc.id !== undefined && this.pending.has(doc.id)) {
      const p = this.pending.get(doc.id);
      this.pending.delete(doc.id);
      if (doc.error) p.reject(new RpcError(doc.error)); else p.resolve(doc.result);
      return;
    }
    if (doc.method === "tickets.event") {
      const s = this.subs.get(doc.params.subscription);
      if (s) s.onEvent(doc.params.event);
    } else if (doc.method === "tickets.watch_end") {
      const s = this.subs.get(doc.params.subscription);
      this.subs.delete(doc.params.subscription);
      if (s && s.onEnd) s.onEnd(doc.params.error);
    }
  }

  async call(method, params) {
    await this.open();
    const id = this.nextId++;
    const msg = { jsonrpc: "2.0", id, method };
    if (params !== undefined) msg.params = params;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.ws.send(JSON.stringify(msg));
    });
  }

  // Events arrive before the promise settles only for history already sent,
  // so the subscription is registered as soon as its name is known.
  async watch(id, fromSeq, onEvent, onEnd) {
    await this.open();
    const rid = this.nextId++;
    const early = [];
    const sub = { onEvent: (e) => early.push(e), onEnd };
    const res = await new Promise((resolve, reject) => {
      this.pending.set(rid, {
        resolve: (r) => { this.subs.set(r.subscription, sub); resolve(r); },
        reject,
      });
      this.ws.send(JSON.stringify({ jsonrpc: "2.0", id: rid, method: "tickets.watch",
                                    params: { id, from_seq: fromSeq, follow: true } }));
    });
    sub.onEvent = onEvent;
    for (const e of early) onEvent(e);
    return res.subscription;
  }

  unwatch(subscription) {
    if (!this.subs.has(subscription)) return;
    this.subs.delete(subscription);
    this.call("tickets.unwatch", { subscription }).catch(() => {});
  }
}
