"""Stands in for spotcr-agent in the local cloud's own tests: prints its argv, or reads IMDS."""

import json
import os
import sys
import urllib.error
import urllib.request

if sys.argv[1] == "imds":
    endpoint = os.environ.get("SPOTCR_IMDS_ENDPOINT", "http://169.254.169.254")
    token_request = urllib.request.Request(
        f"{endpoint}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    )
    token = urllib.request.urlopen(token_request).read().decode()
    request = urllib.request.Request(f"{endpoint}/latest/{sys.argv[2]}", headers={"X-aws-ec2-metadata-token": token})
    try:
        print(urllib.request.urlopen(request).read().decode())
    except urllib.error.HTTPError as error:
        sys.exit(4 if error.code == 404 else 1)
else:
    endpoint = os.environ.get("SPOTCR_IMDS_ENDPOINT", "http://169.254.169.254")
    token_request = urllib.request.Request(
        f"{endpoint}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    )
    token = urllib.request.urlopen(token_request).read().decode()
    request = urllib.request.Request(
        f"{endpoint}/latest/meta-data/instance-id", headers={"X-aws-ec2-metadata-token": token}
    )
    print(json.dumps({"argv": sys.argv[1:], "instance": urllib.request.urlopen(request).read().decode()}))
