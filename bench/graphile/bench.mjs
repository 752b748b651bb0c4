// Graphile Worker's side of bench/baselines.py: one scenario per call, one JSON line out.
//
//   node bench.mjs URL submit_one N
//   node bench.mjs URL submit_batch N BATCH
//   node bench.mjs URL drain N CONCURRENCY [tuned]
//   node bench.mjs URL pickup SAMPLES SPACING_MS CONCURRENCY
//
// The same shapes as the other systems: a trivial task, jobs added one at a time
// (addJob) or in batches (addJobs), drained at a concurrency, timed from the first task
// start to the queue found empty (Graphile Worker deletes finished jobs). `tuned` is its
// own high-throughput settings: a local queue of 500 jobs and batched completion.
import { performance } from "node:perf_hooks";
import { Logger, makeWorkerUtils, run, runMigrations } from "graphile-worker";
import pg from "pg";

const [url, scenario, ...rest] = process.argv.slice(2);
const logger = new Logger(() => () => {}); // silent: the bench prints one JSON line

function out(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

async function count(client) {
  const r = await client.query("SELECT count(*)::int AS n FROM graphile_worker._private_jobs");
  return r.rows[0].n;
}

async function main() {
  await runMigrations({ connectionString: url, logger });
  const utils = await makeWorkerUtils({ connectionString: url, logger });
  try {
    if (scenario === "submit_one") {
      const n = Number(rest[0]);
      const t0 = performance.now();
      for (let i = 0; i < n; i++) await utils.addJob("noop", { i });
      const s = (performance.now() - t0) / 1000;
      out({ n, seconds: s, per_s: n / s });
    } else if (scenario === "submit_batch") {
      const [n, batch] = rest.map(Number);
      const t0 = performance.now();
      for (let i = 0; i < n; i += batch) {
        const specs = [];
        for (let j = i; j < Math.min(n, i + batch); j++) specs.push({ identifier: "noop", payload: { i: j } });
        await utils.addJobs(specs);
      }
      const s = (performance.now() - t0) / 1000;
      out({ n, seconds: s, per_s: n / s });
    } else if (scenario === "drain") {
      const [n, concurrency] = rest.slice(0, 2).map(Number);
      const tuned = rest[2] === "tuned";
      for (let i = 0; i < n; i += 1000) {
        const specs = [];
        for (let j = i; j < Math.min(n, i + 1000); j++) specs.push({ identifier: "noop", payload: { i: j } });
        await utils.addJobs(specs);
      }
      if (rest[3] === "analyze") await utils.withPgClient((c) => c.query("ANALYZE"));
      let first = null;
      const taskList = {
        noop: async () => {
          if (first === null) first = performance.now();
        },
      };
      const preset = tuned
        ? { worker: { localQueue: { size: 500 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 } }
        : {};
      const runner = await run({
        connectionString: url,
        concurrency,
        noHandleSignals: true,
        pollInterval: 1000,
        taskList,
        logger,
        preset,
      });
      const client = new pg.Client({ connectionString: url });
      await client.connect();
      while ((await count(client)) > 0) await new Promise((r) => setTimeout(r, 10));
      const end = performance.now();
      await client.end();
      await runner.stop();
      const s = (end - first) / 1000;
      out({ n, seconds: s, per_s: n / s, tuned });
    } else if (scenario === "pickup") {
      const [samples, spacing, concurrency] = rest.map(Number);
      const started = new Map();
      const taskList = {
        noop: async (payload) => {
          started.set(payload.i, performance.now());
        },
      };
      const runner = await run({
        connectionString: url,
        concurrency,
        noHandleSignals: true,
        pollInterval: 1000,
        taskList,
        logger,
      });
      await new Promise((r) => setTimeout(r, 500));
      const returned = new Map();
      for (let i = 0; i < samples; i++) {
        await utils.addJob("noop", { i });
        returned.set(i, performance.now());
        await new Promise((r) => setTimeout(r, spacing));
      }
      const deadline = performance.now() + 10000;
      while (started.size < samples && performance.now() < deadline) await new Promise((r) => setTimeout(r, 10));
      await runner.stop();
      const latencies = [];
      for (const [i, t] of returned) if (started.has(i)) latencies.push((started.get(i) - t) / 1000);
      out({ n: latencies.length, latency_s: latencies });
    } else {
      throw new Error(`unknown scenario ${scenario}`);
    }
  } finally {
    await utils.release();
  }
}

main().then(
  () => process.exit(0),
  (e) => {
    console.error(e);
    process.exit(1);
  },
);
