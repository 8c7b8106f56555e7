"""A service outside the job, on another VM: echoes each line back to each client, on 0.0.0.0:PORT."""

import socketserver
import sys


class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line)


socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("0.0.0.0", int(sys.argv[1])), Echo).serve_forever()
