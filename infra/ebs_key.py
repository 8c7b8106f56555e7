"""What the caller of RunInstances and CreateVolume needs on a customer managed EBS key, the account's default one
included (Amazon EBS User Guide, "Requirements for Amazon EBS encryption", permissions for users): EC2 uses the key
as the caller, so these are allowed only as EC2 uses them for this account in this region. The AWS-managed aws/ebs
key needs none of it. One home for the job-launching roles' grants (infra/grants.py) and the user's (user_policy).
"""

from __future__ import annotations

USE_ACTIONS = (
    "kms:Decrypt",
    "kms:DescribeKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
)
GRANT_ACTION = "kms:CreateGrant"  # only for an AWS resource (the volume), as EC2 makes it
GRANT_FOR_AWS_RESOURCE = {"Bool": {"kms:GrantIsForAWSResource": "true"}}


def through_ec2(region: str, account: str) -> dict[str, dict[str, str]]:
    """The condition block: the key used by EC2 in this region, for a caller in this account."""
    return {"StringEquals": {"kms:ViaService": f"ec2.{region}.amazonaws.com", "kms:CallerAccount": account}}
