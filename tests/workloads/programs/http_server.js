// A Node job: an HTTP server on every address, and a keep-alive client that asks it for numbered answers.
// The client connects to the VM's own (non-loopback) address, found anew for each request, and asks again
// after a reset: a connection closed by a move to another address is a network blip to it.
"use strict";
const crypto = require("crypto");
const fs = require("fs");
const http = require("http");
const os = require("os");

const PORT = 8088;
const [steps, paceMs] = process.argv.slice(2).map(Number);

function ownAddress() {
  for (const addresses of Object.values(os.networkInterfaces())) {
    for (const a of addresses) if (a.family === "IPv4" && !a.internal) return a.address;
  }
  return "127.0.0.1";
}

function answer(i) {
  return crypto.createHash("sha256").update(`answer-${i}`).digest("hex");
}

const server = http.createServer((req, res) => {
  const i = Number(new URL(req.url, "http://x").searchParams.get("i"));
  res.end(`${i} ${answer(i)}\n`);
});

const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });

function get(i) {
  return new Promise((resolve, reject) => {
    const req = http.get({ host: ownAddress(), port: PORT, path: `/?i=${i}`, agent }, (res) => {
      let body = "";
      res.on("data", (chunk) => (body += chunk));
      res.on("end", () => resolve(body));
      res.on("error", reject);
    });
    req.on("error", reject);
    req.setTimeout(5000, () => req.destroy(new Error("timeout")));
  });
}

async function getWithRetry(i) {
  for (;;) {
    try {
      return await get(i);
    } catch (error) {
      fs.appendFileSync("retries.log", `${i} ${error.code || error.message}\n`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }
}

server.listen(PORT, "0.0.0.0", async () => {
  const result = fs.openSync("result.txt", "w");
  for (let i = 0; i < steps; i++) {
    fs.writeSync(result, await getWithRetry(i));
    fs.appendFileSync("progress.log", `step ${i}\n`);
    await new Promise((r) => setTimeout(r, paceMs));
  }
  fs.closeSync(result);
  agent.destroy();
  server.close();
});
