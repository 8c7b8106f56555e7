"""IAM's policy evaluation, as strict as AWS's, for the local AWS: pure Python, no moto, no boto3.

The rules, in AWS's order (IAM User Guide, "Policy evaluation logic", one account):
1. An explicit Deny in any policy (identity, permissions boundary, session, the resource's own policy where its
   statement names the caller) that matches the request denies it.
2. Else an Allow must match in the identity policies, or in the resource's policy naming the caller (same account:
   either allows; a statement naming the account root only delegates to the identity policies, as AWS reads it),
3. and in the permissions boundary when the principal has one,
4. and in the session policies when the session was given any; else the request is implicitly denied.
A statement matches when its Action (or NotAction), its Resource (or NotResource) and every condition match.
Anything this evaluator does not understand (an operator, an element, a value) raises PolicyError: never an allow.
"""

from __future__ import annotations

import base64
import binascii
import copy
import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

ContextValue = str | bool | int | tuple[str, ...]  # tuple: a multivalued key (aws:TagKeys)

VERSIONS = ("2012-10-17", "2008-10-17")
VARIABLES_VERSION = "2012-10-17"  # policy variables exist from this version on; before it `${x}` is plain text
STATEMENT_ELEMENTS = frozenset({"Sid", "Effect", "Action", "NotAction", "Resource", "NotResource", "Condition"})
POLICY_ELEMENTS = frozenset({"Version", "Id", "Statement"})
QUALIFIERS = ("ForAllValues:", "ForAnyValue:")
IF_EXISTS = "IfExists"


class PolicyError(ValueError):
    """A policy or request this evaluator cannot judge exactly as AWS does; the message names what and where."""


@dataclass(frozen=True)
class Request:
    action: str  # "ec2:CreateTags"
    resource: str  # one ARN, or "*" for actions without resource-level permissions
    context: Mapping[str, ContextValue] = field(default_factory=dict)  # keys match case-insensitively
    # The resource's own policy (a bucket policy, a key policy, a function's permissions), in the caller's account.
    resource_policy: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Principal:
    arn: str  # arn:aws:iam::<acct>:role/<name>, or an assumed-role session's ARN
    policies: tuple[Mapping[str, Any], ...]  # identity policy documents
    boundary: Mapping[str, Any] | None = None  # permissions boundary
    session_policies: tuple[Mapping[str, Any], ...] = ()
    tags: Mapping[str, str] = field(default_factory=dict)  # principal or session tags: aws:PrincipalTag/<key>


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str  # names the deciding statement, or what allows nothing


def evaluate(principal: Principal, request: Request) -> Decision:
    """AWS's decision on one request by this principal (see the module's docstring for the order)."""
    identity = [_parsed(d, f"identity policy {_label(d, i)}") for i, d in enumerate(principal.policies)]
    boundary = _parsed(principal.boundary, "permissions boundary") if principal.boundary is not None else None
    sessions = [_parsed(d, f"session policy {_label(d, i)}") for i, d in enumerate(principal.session_policies)]
    context = _Context(principal, request)
    on = f"{request.action} on {request.resource}"
    resource = [_resource_statements(request.resource_policy, principal)] if request.resource_policy else []
    every = [*identity, *([boundary] if boundary else []), *sessions, *resource]
    for policy in every:
        for statement in policy.statements:
            if statement.effect == "Deny" and statement.matches(request, context):
                return Decision(False, f"explicit deny of {on} by {policy.name} statement {statement.name}")
    allowed_by = _first_allow([*identity, *resource], request, context)
    if allowed_by is None:
        return Decision(False, f"no statement allows {on} (implicit deny)")
    reasons = [allowed_by]
    if boundary is not None:
        by_boundary = _first_allow([boundary], request, context)
        if by_boundary is None:
            return Decision(False, f"the permissions boundary allows no {on} (implicit deny)")
        reasons.append(by_boundary)
    if sessions:
        by_session = _first_allow(sessions, request, context)
        if by_session is None:
            return Decision(False, f"no session policy allows {on} (implicit deny)")
        reasons.append(by_session)
    return Decision(True, f"{on} allowed by {' and '.join(reasons)}")


def evaluate_all(principal: Principal, requests: Iterable[Request]) -> Decision:
    """Allowed only when every request is (one API call can need several): else the first denial."""
    reasons = []
    for request in requests:
        decision = evaluate(principal, request)
        if not decision.allowed:
            return decision
        reasons.append(decision.reason)
    if not reasons:
        raise PolicyError("no request to evaluate: an API call makes at least one")
    return Decision(True, "; ".join(reasons))


# id(document) -> (a deep copy of the document as parsed, its name, the parse): a role's few policies are evaluated on
# every request, and parsing them was most of the evaluation. The copy is compared with the document each time, so
# a document changed in place since is parsed again.
_PARSED: dict[int, tuple[Any, str, _Policy]] = {}
_PARSED_MAX = 1024


def _parsed(document: Mapping[str, Any], name: str) -> _Policy:
    """_Policy.parse(document, name), parsed once while the document stays as it was."""
    cached = _PARSED.get(id(document))
    if cached is not None and cached[1] == name and cached[0] == document:
        return cached[2]
    policy = _Policy.parse(document, name)
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.clear()
    _PARSED[id(document)] = (copy.deepcopy(document), name, policy)
    return policy


def _label(document: Mapping[str, Any], index: int) -> str:
    return f"{document['Id']!r}" if isinstance(document, Mapping) and document.get("Id") else f"#{index}"


def _first_allow(policies: Sequence[_Policy], request: Request, context: _Context) -> str | None:
    for policy in policies:
        for statement in policy.statements:
            if statement.effect == "Allow" and statement.matches(request, context):
                return f"{policy.name} statement {statement.name}"
    return None


def _resource_statements(document: Mapping[str, Any], principal: Principal) -> _Policy:
    """The statements of a resource's policy that name this caller (Principal), as one policy to evaluate."""
    if not isinstance(document, Mapping) or not isinstance(document.get("Statement"), (list, Mapping)):
        raise PolicyError("resource policy: a JSON object with a Statement")
    raw = document["Statement"] if isinstance(document["Statement"], list) else [document["Statement"]]
    named = []
    for index, statement in enumerate(raw):
        where = f"resource policy statement #{index}"
        if not isinstance(statement, Mapping) or "NotPrincipal" in statement:
            raise PolicyError(f"{where}: a statement with a Principal (NotPrincipal is not evaluated here)")
        if "Principal" not in statement:
            raise PolicyError(f"{where}: a resource policy's statement names its Principal")
        if _names(statement["Principal"], principal, where):
            named.append({k: v for k, v in statement.items() if k != "Principal"})
    if not named:
        return _Policy("resource policy", ())
    body = {"Version": document.get("Version", "2008-10-17"), "Statement": named}
    return _Policy.parse(body, "resource policy")


def _names(value: Any, principal: Principal, where: str) -> bool:
    """Whether a Principal element names the caller: "*", its ARN, or (for a role's session) its role's ARN. The
    account root is not the caller here: it delegates to the identity policies. Services name no spotcr principal."""
    if value == "*":
        return True
    if not isinstance(value, Mapping) or set(value) - {"AWS", "Service", "Federated", "CanonicalUser"}:
        raise PolicyError(f'{where}: Principal must be "*" or a JSON object of AWS/Service/... keys')
    if "AWS" not in value:
        return False
    role = _principal_keys(principal).get("aws:PrincipalArn")
    return any(arn in ("*", principal.arn, role) for arn in _strings(value["AWS"], f"{where} Principal AWS"))


class _Unresolved(Exception):
    """A policy variable whose key the request lacks: AWS then treats the statement as not matching."""


class _Context:
    """The request context with keys folded to lower case (AWS matches key names case-insensitively)."""

    def __init__(self, principal: Principal, request: Request) -> None:
        values: dict[str, ContextValue] = {}
        for key, value in _principal_keys(principal).items():
            values[key.lower()] = value
        seen: dict[str, str] = {}
        for key, value in request.context.items():
            folded = key.lower()
            if folded in seen:
                raise PolicyError(f"request context has both {seen[folded]!r} and {key!r}: keys are case-insensitive")
            seen[folded] = key
            values[folded] = value
        self.values = values

    def get(self, key: str) -> ContextValue | None:
        value = self.values.get(key.lower())
        return None if value == () else value  # an empty multivalued key is as absent

    def variable(self, key: str) -> str:
        value = self.get(key)
        if value is None:
            raise _Unresolved(key)
        if isinstance(value, tuple):
            raise PolicyError(f"policy variable ${{{key}}} names a multivalued key, which AWS does not allow")
        return _text(value)


def _principal_keys(principal: Principal) -> dict[str, ContextValue]:
    """The keys AWS derives from the caller itself; the request's context may add to or override them."""
    keys: dict[str, ContextValue] = {f"aws:PrincipalTag/{k}": v for k, v in principal.tags.items()}
    parts = principal.arn.split(":", 5)
    if len(parts) == 6:
        keys["aws:PrincipalAccount"] = parts[4]
        kind, _, rest = parts[5].partition("/")
        if parts[2] == "sts" and kind == "assumed-role":
            keys["aws:PrincipalArn"] = f"arn:{parts[1]}:iam::{parts[4]}:role/{rest.split('/')[0]}"
        else:
            keys["aws:PrincipalArn"] = principal.arn
        if parts[2] == "iam" and kind == "user":
            keys["aws:username"] = rest.rsplit("/", 1)[-1]
    return keys


def _text(value: ContextValue) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class _Policy:
    name: str
    statements: tuple[_Statement, ...]

    @classmethod
    def parse(cls, document: Mapping[str, Any], name: str) -> _Policy:
        if not isinstance(document, Mapping):
            raise PolicyError(f"{name}: a policy is a JSON object, not {type(document).__name__}")
        unknown = set(document) - POLICY_ELEMENTS
        if unknown:
            raise PolicyError(f"{name}: unknown policy element(s) {sorted(unknown)}")
        version = document.get("Version", "2008-10-17")
        if version not in VERSIONS:
            raise PolicyError(f"{name}: unknown Version {version!r}")
        raw = document.get("Statement")
        if isinstance(raw, Mapping):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise PolicyError(f"{name}: Statement must be a statement or a non-empty list of them")
        statements = tuple(
            _Statement.parse(s, f"{name} statement #{i}", version == VARIABLES_VERSION) for i, s in enumerate(raw)
        )
        return cls(name, statements)


@dataclass(frozen=True)
class _Statement:
    name: str
    effect: str
    actions: tuple[str, ...]
    not_action: bool
    resources: tuple[str, ...]
    not_resource: bool
    conditions: tuple[_Condition, ...]
    variables: bool

    @classmethod
    def parse(cls, raw: Any, where: str, variables: bool) -> _Statement:
        if not isinstance(raw, Mapping):
            raise PolicyError(f"{where}: a statement is a JSON object")
        unknown = set(raw) - STATEMENT_ELEMENTS
        if unknown:
            raise PolicyError(f"{where}: element(s) {sorted(unknown)} are not valid in an identity-based policy")
        sid = raw.get("Sid")
        name = repr(sid) if sid else where.rsplit(" ", 1)[-1]
        effect = raw.get("Effect")
        if effect not in ("Allow", "Deny"):
            raise PolicyError(f"{where}: Effect must be Allow or Deny, not {effect!r}")
        action_key = _exactly_one(raw, "Action", "NotAction", where)
        resource_key = _exactly_one(raw, "Resource", "NotResource", where)
        actions = _strings(raw[action_key], f"{where} {action_key}")
        for action in actions:
            if action != "*" and not re.fullmatch(r"[A-Za-z0-9-]+:[A-Za-z0-9*?]+", action):
                raise PolicyError(f"{where}: {action!r} is not an action (service:Action)")
        resources = _strings(raw[resource_key], f"{where} {resource_key}")
        for resource in resources if variables else ():
            _check_variables(resource, f"{where} {resource_key}")
        condition = raw.get("Condition", {})
        if not isinstance(condition, Mapping):
            raise PolicyError(f"{where}: Condition must be a JSON object")
        conditions = tuple(
            _Condition.parse(operator, key, values, f"{where} Condition {operator}", variables)
            for operator, block in condition.items()
            for key, values in _block(block, f"{where} Condition {operator}").items()
        )
        return cls(
            name=name,
            effect=effect,
            actions=actions,
            not_action=action_key == "NotAction",
            resources=resources,
            not_resource=resource_key == "NotResource",
            conditions=conditions,
            variables=variables,
        )

    def matches(self, request: Request, context: _Context) -> bool:
        action = any(_action_matches(a, request.action) for a in self.actions)
        if action == self.not_action:
            return False
        try:
            resource = any(self._resource_matches(r, request.resource, context) for r in self.resources)
            if resource == self.not_resource:
                return False
            return all(c.holds(context, self.variables) for c in self.conditions)
        except _Unresolved:
            return False  # AWS: a variable it cannot resolve makes the statement not apply

    def _resource_matches(self, pattern: str, resource: str, context: _Context) -> bool:
        if pattern == "*":
            return True
        return _arn_like(_pieces(pattern, context, self.variables), resource)


def _exactly_one(raw: Mapping[str, Any], one: str, other: str, where: str) -> str:
    if (one in raw) == (other in raw):
        raise PolicyError(f"{where}: needs exactly one of {one} and {other}")
    return one if one in raw else other


def _strings(value: Any, where: str) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise PolicyError(f"{where}: must be a string or a non-empty list of strings, not {value!r}")
    return tuple(values)


def _block(block: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(block, Mapping) or not block:
        raise PolicyError(f"{where}: must map condition keys to values")
    return block


def _action_matches(pattern: str, action: str) -> bool:
    return re.fullmatch(_glob(pattern), action, re.IGNORECASE | re.DOTALL) is not None


def _glob(text: str) -> str:
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in text)


# A pattern after policy variables are put in: literal text, or a wildcard ("*" or "?") that `${*}`/`${?}` escape.
_Piece = tuple[str, bool]  # (text, is_wildcard)
_VARIABLE = re.compile(r"\$\{([^}]*)\}")
_DEFAULT = re.compile(r"^\s*([^,]+?)\s*,\s*'([^']*)'\s*$")


def _pieces(pattern: str, context: _Context, variables: bool) -> list[_Piece]:
    pieces: list[_Piece] = []

    def literal(text: str) -> None:
        for char in text:
            pieces.append((char, char in "*?"))

    if not variables:
        literal(pattern)
        return pieces
    position = 0
    for match in _VARIABLE.finditer(pattern):
        literal(pattern[position : match.start()])
        pieces.extend((char, False) for char in _resolve(match[1], context))
        position = match.end()
    literal(pattern[position:])
    return pieces


def _check_variables(text: str, where: str) -> None:
    """Policy variables are read when the policy is, so that a malformed one fails every request, not some."""
    for match in _VARIABLE.finditer(text):
        _variable_key(match[1], where)
    if "${" in _VARIABLE.sub("", text):
        raise PolicyError(f"{where}: unterminated policy variable in {text!r}")


def _variable_key(variable: str, where: str) -> tuple[str, re.Match[str] | None]:
    default = _DEFAULT.match(variable)
    key = default[1] if default else variable.strip()
    if variable not in ("*", "?", "$") and not re.fullmatch(r"[A-Za-z0-9-]+:\S+", key):
        raise PolicyError(f"{where}: ${{{variable}}} is not a policy variable (a condition key, or *, ? or $)")
    return key, default


def _resolve(variable: str, context: _Context) -> str:
    if variable in ("*", "?", "$"):
        return variable
    key, default = _variable_key(variable, "policy")
    try:
        return context.variable(key)
    except _Unresolved:
        if default:
            return default[2]
        raise


def _regex(pieces: Sequence[_Piece], wildcards: bool, ignore_case: bool = False) -> re.Pattern[str]:
    body = "".join(
        (".*" if text == "*" else ".") if wildcard and wildcards else re.escape(text) for text, wildcard in pieces
    )
    return re.compile(body, (re.IGNORECASE if ignore_case else 0) | re.DOTALL)


def _arn_like(pattern: Sequence[_Piece], arn: str) -> bool:
    """ARN matching as IAM does it: the six colon-separated parts each on their own, case-sensitive, wildcards
    within a part (the last part, the resource, may itself hold colons)."""
    parts: list[list[_Piece]] = [[]]
    for piece in pattern:
        if piece == (":", False) and len(parts) < 6:
            parts.append([])
        else:
            parts[-1].append(piece)
    values = arn.split(":", 5)
    if len(parts) != 6 or len(values) != 6:
        return False
    return all(_regex(p, wildcards=True).fullmatch(v) is not None for p, v in zip(parts, values, strict=True))


# Each operator compares one request value with one policy value (already expanded when it takes variables).
_Compare = Callable[[ContextValue, Any], bool]


def _string_equals(value: ContextValue, pattern: re.Pattern[str]) -> bool:
    return not isinstance(value, tuple) and pattern.fullmatch(_text(value)) is not None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise PolicyError(f"{where}: {value!r} is not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise PolicyError(f"{where}: {value!r} is not a number") from None


def _request_number(value: ContextValue) -> float | None:
    try:
        return None if isinstance(value, bool | tuple) else float(value)
    except ValueError:
        return None


def _date(value: Any, where: str) -> datetime:
    parsed = _request_date(value)
    if parsed is None:
        raise PolicyError(f"{where}: {value!r} is not a date (ISO 8601 or epoch seconds)")
    return parsed


def _request_date(value: Any) -> datetime | None:
    if isinstance(value, bool | tuple):
        return None
    text = str(value)
    try:
        if re.fullmatch(r"-?[0-9]+", text):
            return datetime.fromtimestamp(int(text), UTC)
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (ValueError, OverflowError):
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _bool_value(value: Any, where: str) -> bool:
    text = _text(value).lower() if isinstance(value, bool | str) else None
    if text not in ("true", "false"):
        raise PolicyError(f"{where}: Bool takes true or false, not {value!r}")
    return text == "true"


def _binary(value: Any, where: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise PolicyError(f"{where}: {value!r} is not base64") from None


def _network(value: Any, where: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(str(value), strict=False)
    except ValueError:
        raise PolicyError(f"{where}: {value!r} is not an IP address or CIDR block") from None


def _in_network(value: ContextValue, network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    try:
        return isinstance(value, str) and ipaddress.ip_address(value) in network
    except ValueError:
        return False


def _numeric(test: Callable[[float, float], bool]) -> _Compare:
    return lambda value, number: (n := _request_number(value)) is not None and test(n, number)


def _dated(test: Callable[[datetime, datetime], bool]) -> _Compare:
    return lambda value, date: (d := _request_date(value)) is not None and test(d, date)


@dataclass(frozen=True)
class _Operator:
    compare: _Compare
    negated: bool = False
    kind: str = "string"  # how a policy value is read: string (with variables), arn, number, date, bool, binary, ip


_EQUALS = _Operator(_string_equals)
_ARN = _Operator(lambda value, pattern: isinstance(value, str) and _arn_like(pattern, value), kind="arn")
OPERATORS: dict[str, _Operator] = {
    "StringEquals": _EQUALS,
    "StringNotEquals": _Operator(_string_equals, negated=True),
    "StringEqualsIgnoreCase": _Operator(_string_equals, kind="string-ignore-case"),
    "StringNotEqualsIgnoreCase": _Operator(_string_equals, negated=True, kind="string-ignore-case"),
    "StringLike": _Operator(_string_equals, kind="string-like"),
    "StringNotLike": _Operator(_string_equals, negated=True, kind="string-like"),
    "NumericEquals": _Operator(_numeric(lambda a, b: a == b), kind="number"),
    "NumericNotEquals": _Operator(_numeric(lambda a, b: a == b), negated=True, kind="number"),
    "NumericLessThan": _Operator(_numeric(lambda a, b: a < b), kind="number"),
    "NumericLessThanEquals": _Operator(_numeric(lambda a, b: a <= b), kind="number"),
    "NumericGreaterThan": _Operator(_numeric(lambda a, b: a > b), kind="number"),
    "NumericGreaterThanEquals": _Operator(_numeric(lambda a, b: a >= b), kind="number"),
    "DateEquals": _Operator(_dated(lambda a, b: a == b), kind="date"),
    "DateNotEquals": _Operator(_dated(lambda a, b: a == b), negated=True, kind="date"),
    "DateLessThan": _Operator(_dated(lambda a, b: a < b), kind="date"),
    "DateLessThanEquals": _Operator(_dated(lambda a, b: a <= b), kind="date"),
    "DateGreaterThan": _Operator(_dated(lambda a, b: a > b), kind="date"),
    "DateGreaterThanEquals": _Operator(_dated(lambda a, b: a >= b), kind="date"),
    "Bool": _Operator(lambda value, wanted: _text(value).lower() == wanted, kind="bool"),
    "BinaryEquals": _Operator(
        lambda value, wanted: isinstance(value, str) and _binary(value, "request") == wanted, kind="binary"
    ),
    "IpAddress": _Operator(_in_network, kind="ip"),
    "NotIpAddress": _Operator(_in_network, negated=True, kind="ip"),
    "ArnEquals": _ARN,
    "ArnLike": _ARN,
    "ArnNotEquals": _Operator(_ARN.compare, negated=True, kind="arn"),
    "ArnNotLike": _Operator(_ARN.compare, negated=True, kind="arn"),
}
NULL = "Null"


def operator_names() -> tuple[str, ...]:
    """Every operator name this evaluator understands (bare; the IfExists suffix and set qualifiers compose)."""
    return (*OPERATORS, NULL)


@dataclass(frozen=True)
class _Condition:
    where: str
    operator: str  # bare name, e.g. StringLike
    qualifier: str  # "", "ForAllValues:" or "ForAnyValue:"
    if_exists: bool
    key: str
    values: tuple[Any, ...]

    @classmethod
    def parse(cls, operator: str, key: str, raw: Any, where: str, variables: bool) -> _Condition:
        qualifier = next((q for q in QUALIFIERS if operator.startswith(q)), "")
        bare = operator.removeprefix(qualifier)
        if_exists = bare.endswith(IF_EXISTS) and bare != IF_EXISTS
        bare = bare.removesuffix(IF_EXISTS) if if_exists else bare
        if bare not in OPERATORS and bare != NULL:
            raise PolicyError(f"{where}: unknown condition operator {operator!r}")
        if bare == NULL and (qualifier or if_exists):
            raise PolicyError(f"{where}: Null takes no set qualifier and no IfExists")
        values = tuple(raw) if isinstance(raw, list) else (raw,)
        if not values or not all(isinstance(v, str | bool | int | float) for v in values):
            raise PolicyError(f"{where}: {key} must map to a value or a list of values, not {raw!r}")
        if bare == NULL and len(values) != 1:
            raise PolicyError(f"{where}: Null takes one value, true or false")
        condition = cls(where, bare, qualifier, if_exists, key, values)
        condition._check_values(variables)
        return condition

    def _check_values(self, variables: bool) -> None:
        """Values that cannot be read are an error now, not a silent mismatch later."""
        read = _bool_value if self.operator == NULL else _READERS.get(OPERATORS[self.operator].kind)
        for value in self.values:
            if read is not None:
                read(value, self.where)
            elif variables:
                _check_variables(_text(value), self.where)

    def holds(self, context: _Context, variables: bool) -> bool:
        present = context.get(self.key)
        if self.operator == NULL:
            return (present is None) == _bool_value(self.values[0], self.where)
        operator = OPERATORS[self.operator]
        if present is None:
            return self._when_absent(operator)
        wanted = [self._expand(v, context, variables, operator.kind) for v in self.values]

        def each(value: ContextValue) -> bool:
            matched = any(operator.compare(value, w) for w in wanted)  # several policy values: OR
            return not matched if operator.negated else matched

        if isinstance(present, tuple):
            if not self.qualifier:
                raise PolicyError(
                    f"{self.where}: {self.key} is multivalued in this request and AWS requires "
                    "ForAllValues: or ForAnyValue: for it"
                )
            results = [each(v) for v in present]
            return all(results) if self.qualifier == "ForAllValues:" else any(results)
        return each(present)

    def _when_absent(self, operator: _Operator) -> bool:
        """AWS: IfExists and ForAllValues hold on an absent (or empty) key, ForAnyValue does not; without either,
        a negated operator holds and any other does not."""
        if self.if_exists or self.qualifier == "ForAllValues:":
            return True
        return operator.negated and not self.qualifier

    def _expand(self, value: Any, context: _Context, variables: bool, kind: str) -> Any:
        read = _READERS.get(kind)
        if read is not None:
            return read(value, self.where)
        pieces = _pieces(_text(value), context, variables)
        if kind == "arn":
            return pieces
        return _regex(pieces, wildcards=kind == "string-like", ignore_case=kind == "string-ignore-case")


# How a policy value of each non-string kind is read (string and ARN values may hold policy variables instead).
_READERS: dict[str, Callable[[Any, str], Any]] = {
    "number": _number,
    "date": _date,
    "bool": lambda value, where: _text(_bool_value(value, where)),
    "binary": _binary,
    "ip": _network,
}
