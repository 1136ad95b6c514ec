//! Input limits: the range of every number and the length of every string the API takes,
//! checked in one place before anything reaches a service. SECURITY.md ("Input limits") is
//! their table.
//!
//! How it holds:
//! - every input object implements [`Validate`] next to its definition (`inputs.rs`),
//!   destructuring itself completely, so a field added without a check does not compile;
//! - resolvers take input objects as [`Validated<T>`], which is `T` on the wire (the SDL does
//!   not change) and whose fields can only be reached through [`Validated::check`];
//! - scalar arguments go through the same [`Field`] checks in their resolver;
//! - a refusal is `BAD_USER_INPUT` whose `extensions.field` names the field as the client
//!   wrote it (`input.reason`, `filter.labels[0].key`, `input.params.sources[1]`), and whose
//!   message never carries a large value back ([`bound_message`] cuts any that would);
//! - a request body that is no GraphQL request is answered with a GraphQL-shaped error
//!   ([`BodyRejection`]), not Rust `Debug` text.

use async_graphql::registry::Registry;
use async_graphql::{ID, InputType, InputValueError, InputValueResult, Value};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bc_core::node::{MAX_HOSTNAME_LEN, MAX_LABEL_PART_LEN, MAX_REASON_LEN};
use chrono::{DateTime, TimeDelta, Utc};
use std::borrow::Cow;
use std::fmt::Display;
use std::ops::RangeInclusive;

use crate::error::ApiError;

// Strings, in bytes of UTF-8. -------------------------------------------------------------

/// Free text kept with a change: cordon, drain, move and revocation reasons (the domain's).
pub const MAX_REASON_BYTES: usize = MAX_REASON_LEN;
/// A join token's description.
pub const MAX_DESCRIPTION_BYTES: usize = 1024;
/// Names of tenants, sites and pools (the domain's).
pub const MAX_NAME_BYTES: usize = bc_core::catalog::MAX_NAME_LEN;
/// A hostname, and a hostname filter (a substring of one).
pub const MAX_HOSTNAME_BYTES: usize = MAX_HOSTNAME_LEN;
/// A label or taint key: a DNS prefix, a slash and a name.
pub const MAX_LABEL_KEY_BYTES: usize = MAX_HOSTNAME_LEN + 1 + MAX_LABEL_PART_LEN;
/// A label or taint value.
pub const MAX_LABEL_VALUE_BYTES: usize = MAX_LABEL_PART_LEN;
/// A `noScheduleReasons` key in a filter (`taint:<key>` is the longest).
pub const MAX_REASON_KEY_BYTES: usize = "taint:".len() + MAX_LABEL_KEY_BYTES;
/// A pool's expected GPU model.
pub const MAX_GPU_MODEL_BYTES: usize = 100;
/// A pool's expected driver version (the domain's rule).
pub const MAX_DRIVER_VERSION_BYTES: usize = bc_core::catalog::MAX_DRIVER_VERSION_LEN;
/// An actor in an event filter (`user:<subject>`, `controller:<name>`, …).
pub const MAX_ACTOR_BYTES: usize = 256;
/// Any id or cursor (`node_…`, `evt_…`): a prefix and at most 64 characters.
pub const MAX_ID_BYTES: usize = 80;
/// A machine identifier's name at enrolment (`mac:<interface>` is the longest).
pub const MAX_IDENTIFIER_NAME_BYTES: usize = 64;
/// A machine identifier's value (a serial, a UUID, a MAC, a TPM endorsement key's hash).
pub const MAX_IDENTIFIER_VALUE_BYTES: usize = 256;
/// A condition's type (the domain's limit).
pub const MAX_CONDITION_TYPE_BYTES: usize = 63;
/// A BMC's address (`https://host[:port]`).
pub const MAX_BMC_ADDRESS_BYTES: usize = crate::bmc::MAX_ADDRESS_BYTES;
/// A Redfish system id.
pub const MAX_BMC_SYSTEM_ID_BYTES: usize = 128;
/// A BMC user name.
pub const MAX_BMC_USERNAME_BYTES: usize = 256;
/// A BMC password.
pub const MAX_BMC_PASSWORD_BYTES: usize = 1024;
/// A CA certificate bundle (PEM) for a BMC: a handful of certificates.
pub const MAX_CA_CERTIFICATE_BYTES: usize = 64 * 1024;
/// A command's `params`, serialised as JSON.
pub const MAX_PARAMS_BYTES: usize = 16 * 1024;
/// How deep a command's `params` may nest (objects and arrays).
pub const MAX_PARAMS_DEPTH: usize = 8;

// Lists. -------------------------------------------------------------------------------------

/// Values in one field of a filter (ids, states, label selectors, reasons).
pub const MAX_FILTER_VALUES: usize = 1_000;
/// The nodes one `sendCommand` may name (as many as a filter may match).
pub const MAX_COMMAND_NODE_IDS: usize = crate::service::commands::MAX_COMMAND_TARGETS as usize;
/// Labels set, or removed, in one `labelNode`.
pub const MAX_LABELS_PER_CHANGE: usize = 100;
/// Driver bindings of one pool.
pub const MAX_DRIVERS: usize = 16;
/// Identifiers one `enrollNode` gives (a machine's serials and UUID, and its MACs).
pub const MAX_IDENTIFIERS: usize = 64;
/// Event types in an event filter (there are fewer than 100 types).
pub const MAX_EVENT_TYPES: usize = 100;
/// Rules of one remediation policy (one per remediated condition).
pub const MAX_REMEDIATION_RULES: usize = 8;
/// Checks of one acceptance policy: each kind at most once.
pub const MAX_ACCEPTANCE_CHECKS: usize = bc_core::acceptance::AcceptanceCheckKind::ALL.len();

// Numbers. -----------------------------------------------------------------------------------

/// A node's `version`, as read.
pub const VERSION: RangeInclusive<i64> = 1..=i64::MAX;
/// `createJoinToken.expiresInSeconds`: up to a year.
pub const JOIN_TOKEN_LIFETIME_SECONDS: RangeInclusive<i64> =
    1..=crate::service::join::MAX_JOIN_TOKEN_LIFETIME.num_seconds();
/// `createJoinToken.maxUses`.
pub const JOIN_TOKEN_USES: RangeInclusive<i64> = 1..=crate::service::join::MAX_JOIN_TOKEN_USES;
/// `sendCommand.timeoutSeconds`: up to 6 hours.
pub const COMMAND_TIMEOUT_SECONDS: RangeInclusive<i64> =
    1..=bc_core::command::MAX_TIMEOUT.num_seconds();
/// `sendCommand.expiresInSeconds`: up to 30 days in the queue.
pub const COMMAND_TTL_SECONDS: RangeInclusive<i64> =
    1..=bc_core::command::MAX_QUEUE_TTL.num_seconds();
/// A remediation step's tries.
pub const REMEDIATION_ATTEMPTS: RangeInclusive<i64> = 1..=bc_core::remediation::MAX_ATTEMPTS as i64;
/// A remediation step's backoff: up to a day.
pub const REMEDIATION_BACKOFF_SECONDS: RangeInclusive<i64> =
    0..=bc_core::remediation::MAX_BACKOFF_SECS as i64;
/// The `diag.nvml` level that verifies a remediation step.
pub const REMEDIATION_VERIFY_LEVEL: RangeInclusive<i64> = 1..=3;
/// An acceptance check's `diag.nvml` level.
pub const ACCEPTANCE_DIAG_LEVEL: RangeInclusive<i64> =
    1..=bc_core::acceptance::MAX_DIAG_LEVEL as i64;
/// `createPool.expectedGpuCount`.
pub const EXPECTED_GPU_COUNT: RangeInclusive<i64> = 0..=1024;
/// Timestamps (`notBefore`, drain `deadline`): from 1970 to 9999, which both databases hold
/// and to which any duration the API takes can be added.
pub const TIMESTAMP_SECONDS: RangeInclusive<i64> = 0..=253_402_300_799;

// Echoes. ------------------------------------------------------------------------------------

/// The longest error message sent; longer ones are cut ([`bound_message`]).
pub const MAX_ERROR_MESSAGE_BYTES: usize = 1024;
/// The longest quoted value or single word an error message repeats whole.
const MAX_ECHO_BYTES: usize = 64;

/// What a string input is, which decides its length and what it may contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Text {
    /// A reason kept with a change: not blank; tabs and line breaks allowed.
    Reason,
    /// A join token's description: may be empty; tabs and line breaks allowed.
    Description,
    /// A tenant, site or pool name (the domain's rule).
    Name,
    /// A node's hostname (DNS syntax).
    Hostname,
    /// A substring of hostnames.
    HostnameFilter,
    /// A gateway replica's id in a filter (`gateway.gateway_id`).
    GatewayId,
    /// A label, taint or driver key (`[prefix/]name`).
    LabelKey,
    /// A label, taint or driver value.
    LabelValue,
    /// A label key in a selector: only its length and characters are checked.
    LabelKeyFilter,
    /// A label value in a selector: only its length and characters are checked.
    LabelValueFilter,
    /// A `noScheduleReasons` key in a filter.
    ReasonFilter,
    /// A pool's expected GPU model.
    GpuModel,
    /// A pool's expected driver version.
    DriverVersion,
    /// An actor in an event filter.
    Actor,
    /// An id or a cursor; its syntax is checked where it is parsed.
    Id,
    /// A machine identifier's name (`system-uuid`, `mac:eth0`, …).
    IdentifierName,
    /// A machine identifier's value.
    IdentifierValue,
    /// A condition's type (`GpuNeedsReset`: PascalCase).
    ConditionType,
    /// A BMC's address.
    BmcAddress,
    /// A Redfish system id.
    BmcSystemId,
    /// A BMC user name.
    BmcUsername,
    /// A BMC password (any printable text).
    BmcPassword,
    /// A CA certificate bundle (PEM: line breaks allowed).
    CaCertificate,
}

impl Text {
    pub const fn max_bytes(self) -> usize {
        match self {
            Text::Reason => MAX_REASON_BYTES,
            Text::Description => MAX_DESCRIPTION_BYTES,
            Text::Name => MAX_NAME_BYTES,
            Text::Hostname | Text::HostnameFilter => MAX_HOSTNAME_BYTES,
            Text::GatewayId => crate::config::MAX_GATEWAY_ID_BYTES,
            Text::LabelKey | Text::LabelKeyFilter => MAX_LABEL_KEY_BYTES,
            Text::LabelValue | Text::LabelValueFilter => MAX_LABEL_VALUE_BYTES,
            Text::ReasonFilter => MAX_REASON_KEY_BYTES,
            Text::GpuModel => MAX_GPU_MODEL_BYTES,
            Text::DriverVersion => MAX_DRIVER_VERSION_BYTES,
            Text::Actor => MAX_ACTOR_BYTES,
            Text::Id => MAX_ID_BYTES,
            Text::IdentifierName => MAX_IDENTIFIER_NAME_BYTES,
            Text::IdentifierValue => MAX_IDENTIFIER_VALUE_BYTES,
            Text::ConditionType => MAX_CONDITION_TYPE_BYTES,
            Text::BmcAddress => MAX_BMC_ADDRESS_BYTES,
            Text::BmcSystemId => MAX_BMC_SYSTEM_ID_BYTES,
            Text::BmcUsername => MAX_BMC_USERNAME_BYTES,
            Text::BmcPassword => MAX_BMC_PASSWORD_BYTES,
            Text::CaCertificate => MAX_CA_CERTIFICATE_BYTES,
        }
    }

    /// Free text may hold tabs and line breaks; nothing may hold other control characters
    /// (PostgreSQL stores no NUL in text or jsonb at all).
    const fn free_text(self) -> bool {
        matches!(self, Text::Reason | Text::Description | Text::CaCertificate)
    }

    /// The domain's own rule for this kind of string, if it has one.
    fn syntax(self, value: &str) -> Result<(), String> {
        let domain = match self {
            Text::Reason if value.trim().is_empty() => return Err("must not be blank".into()),
            Text::Name => bc_core::catalog::validate_name("", value),
            Text::Hostname => bc_core::node::validate_hostname(value),
            Text::LabelKey => bc_core::node::validate_label_key(value),
            Text::LabelValue => bc_core::node::validate_label_value(value),
            Text::IdentifierName => bc_core::hardware::validate_identifier_name(value),
            Text::DriverVersion => bc_core::catalog::validate_driver_version(value),
            Text::ConditionType if !bc_core::reason::is_condition_type(value) => {
                return Err("is not a condition type (PascalCase letters and digits)".into());
            }
            Text::BmcSystemId => {
                return crate::bmc::validate_system_id(value);
            }
            Text::BmcUsername if value.is_empty() => return Err("must not be empty".into()),
            _ => Ok(()),
        };
        domain.map_err(|err| match self {
            Text::Name => format!(
                "is not a valid name (1-{MAX_NAME_BYTES} printable characters, no surrounding spaces)"
            ),
            Text::Hostname => "is not a valid hostname (DNS labels of a-z, 0-9 and -)".into(),
            _ => format!("is invalid: {err}"),
        })
    }
}

/// Where in the input a value is, as the client wrote it: `input.set[0].key`.
#[derive(Debug, Clone)]
pub struct Field {
    path: String,
}

impl Field {
    /// An argument of a field (`input`, `filter`, `name`).
    pub fn argument(name: &str) -> Field {
        Field {
            path: name.to_owned(),
        }
    }

    /// A field of this input object.
    pub fn at(&self, name: &str) -> Field {
        Field {
            path: format!("{}.{name}", self.path),
        }
    }

    /// An element of this list.
    pub fn index(&self, index: usize) -> Field {
        Field {
            path: format!("{}[{index}]", self.path),
        }
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// `BAD_USER_INPUT` about this field: "`input.reason` `why`".
    pub fn refuse(&self, why: impl Display) -> ApiError {
        ApiError::InvalidField {
            field: self.path.clone(),
            message: format!("`{}` {why}", self.path),
        }
    }

    /// A string of `kind`: its length, its characters, then the domain's syntax for it.
    pub fn text(&self, value: &str, kind: Text) -> Result<(), ApiError> {
        let max = kind.max_bytes();
        if value.len() > max {
            return Err(self.refuse(format_args!(
                "is longer than {max} bytes ({} bytes)",
                value.len()
            )));
        }
        check_characters(value, kind.free_text()).map_err(|why| self.refuse(why))?;
        kind.syntax(value).map_err(|why| self.refuse(why))
    }

    /// An optional string of `kind`.
    pub fn text_opt(&self, value: Option<&str>, kind: Text) -> Result<(), ApiError> {
        value.map_or(Ok(()), |value| self.text(value, kind))
    }

    /// An id or cursor: bounded, printable; its prefix and syntax are checked where it is
    /// parsed into the id it names.
    pub fn id(&self, value: &ID) -> Result<(), ApiError> {
        self.text(value.as_str(), Text::Id)
    }

    /// An integer within `range`.
    pub fn int(&self, value: i64, range: RangeInclusive<i64>) -> Result<(), ApiError> {
        if range.contains(&value) {
            Ok(())
        } else {
            Err(self.refuse(format_args!(
                "must be between {} and {} (got {value})",
                range.start(),
                range.end()
            )))
        }
    }

    /// An optional integer within `range`.
    pub fn int_opt(&self, value: Option<i64>, range: RangeInclusive<i64>) -> Result<(), ApiError> {
        value.map_or(Ok(()), |value| self.int(value, range))
    }

    /// A timestamp that parsed and lies within [`TIMESTAMP_SECONDS`].
    pub fn time(&self, value: Option<&Timestamp>) -> Result<(), ApiError> {
        match value.map(|t| &t.0) {
            None => Ok(()),
            Some(Err(why)) => Err(self.refuse(format_args!(
                "is not an RFC 3339 timestamp between 1970 and 9999 ({why})"
            ))),
            Some(Ok(at)) if !TIMESTAMP_SECONDS.contains(&at.timestamp()) => {
                Err(self.refuse("must be a time between 1970-01-01 and 9999-12-31"))
            }
            Some(Ok(_)) => Ok(()),
        }
    }

    /// A list of at most `max` items, each checked by `each`.
    pub fn list<T>(
        &self,
        items: &[T],
        max: usize,
        each: impl Fn(&Field, &T) -> Result<(), ApiError>,
    ) -> Result<(), ApiError> {
        if items.len() > max {
            return Err(self.refuse(format_args!("has more than {max} items ({})", items.len())));
        }
        items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| each(&self.index(i), item))
    }

    /// An optional list of at most `max` items, each checked by `each`.
    pub fn list_opt<T>(
        &self,
        items: Option<&[T]>,
        max: usize,
        each: impl Fn(&Field, &T) -> Result<(), ApiError>,
    ) -> Result<(), ApiError> {
        items.map_or(Ok(()), |items| self.list(items, max, each))
    }

    /// A list whose items need no check of their own (enum values), only a bound.
    pub fn bounded<T>(&self, items: Option<&[T]>, max: usize) -> Result<(), ApiError> {
        self.list_opt(items, max, |_, _| Ok(()))
    }

    /// A nested input object.
    pub fn object(&self, value: &impl Validate) -> Result<(), ApiError> {
        value.validate(self)
    }

    /// Arbitrary JSON (a command's `params`): at most [`MAX_PARAMS_BYTES`] serialised and
    /// [`MAX_PARAMS_DEPTH`] deep, and no control character in any key or string.
    pub fn json(&self, value: &serde_json::Value) -> Result<(), ApiError> {
        let size = serde_json::to_vec(value).map_or(usize::MAX, |bytes| bytes.len());
        if size > MAX_PARAMS_BYTES {
            return Err(self.refuse(format_args!(
                "is larger than {MAX_PARAMS_BYTES} bytes of JSON ({size} bytes)"
            )));
        }
        self.json_at(value, 0)
    }

    fn json_at(&self, value: &serde_json::Value, depth: usize) -> Result<(), ApiError> {
        use serde_json::Value as Json;
        if depth >= MAX_PARAMS_DEPTH && matches!(value, Json::Array(_) | Json::Object(_)) {
            return Err(self.refuse(format_args!("nests deeper than {MAX_PARAMS_DEPTH} levels")));
        }
        match value {
            Json::String(s) => check_characters(s, false).map_err(|why| self.refuse(why)),
            Json::Array(items) => items
                .iter()
                .enumerate()
                .try_for_each(|(i, item)| self.index(i).json_at(item, depth + 1)),
            Json::Object(map) => map.iter().try_for_each(|(key, item)| {
                check_characters(key, false)
                    .map_err(|why| self.refuse(format_args!("has a key that {why}")))?;
                self.at(key).json_at(item, depth + 1)
            }),
            Json::Null | Json::Bool(_) | Json::Number(_) => Ok(()),
        }
    }
}

/// No control characters, but tabs and line breaks in free text.
fn check_characters(value: &str, free_text: bool) -> Result<(), String> {
    let allowed = |c: char| free_text && matches!(c, '\t' | '\n' | '\r');
    match value.chars().find(|c| c.is_control() && !allowed(*c)) {
        None => Ok(()),
        Some('\0') => Err("contains a NUL byte".into()),
        Some(c) => Err(format!(
            "contains a control character (U+{:04X})",
            u32::from(c)
        )),
    }
}

/// An input object whose fields have limits.
pub trait Validate {
    /// Checks every field, naming the first that is out of bounds. Implementations destructure
    /// `self` completely (no `..`), so that a field added later must be checked to compile.
    fn validate(&self, at: &Field) -> Result<(), ApiError>;
}

/// An input object as a resolver receives it: `T` on the wire, reachable only through
/// [`Validated::check`].
pub struct Validated<T>(T);

impl<T: Validate> Validated<T> {
    /// `T`, every field checked; `argument` is the argument's name, the first segment of the
    /// field a refusal names.
    pub fn check(self, argument: &str) -> Result<T, ApiError> {
        self.0.validate(&Field::argument(argument))?;
        Ok(self.0)
    }
}

impl<T: InputType> InputType for Validated<T> {
    type RawValueType = T::RawValueType;

    fn type_name() -> Cow<'static, str> {
        T::type_name()
    }

    fn qualified_type_name() -> String {
        T::qualified_type_name()
    }

    fn create_type_info(registry: &mut Registry) -> String {
        T::create_type_info(registry)
    }

    fn parse(value: Option<Value>) -> InputValueResult<Self> {
        T::parse(value)
            .map(Validated)
            .map_err(InputValueError::propagate)
    }

    fn to_value(&self) -> Value {
        self.0.to_value()
    }

    fn as_raw_value(&self) -> Option<&Self::RawValueType> {
        self.0.as_raw_value()
    }
}

/// A `DateTime` input (RFC 3339) whose parse failure is reported by [`Field::time`], naming
/// the field, instead of by the scalar, which names only the type. The same `DateTime` on the
/// wire.
#[derive(Debug, Clone)]
pub struct Timestamp(Result<DateTime<Utc>, String>);

impl Timestamp {
    /// The time, once [`Field::time`] accepted it.
    pub fn value(&self) -> Result<DateTime<Utc>, ApiError> {
        self.0
            .clone()
            .map_err(|_| ApiError::BadUserInput("a timestamp is not RFC 3339".into()))
    }
}

impl From<DateTime<Utc>> for Timestamp {
    fn from(at: DateTime<Utc>) -> Self {
        Timestamp(Ok(at))
    }
}

impl InputType for Timestamp {
    type RawValueType = Self;

    fn type_name() -> Cow<'static, str> {
        <DateTime<Utc> as InputType>::type_name()
    }

    fn create_type_info(registry: &mut Registry) -> String {
        <DateTime<Utc> as InputType>::create_type_info(registry)
    }

    fn parse(value: Option<Value>) -> InputValueResult<Self> {
        match value {
            Some(Value::String(raw)) => Ok(Timestamp(
                raw.parse::<DateTime<Utc>>().map_err(|err| err.to_string()),
            )),
            other => <DateTime<Utc> as InputType>::parse(other)
                .map(Timestamp::from)
                .map_err(InputValueError::propagate),
        }
    }

    fn to_value(&self) -> Value {
        match &self.0 {
            Ok(at) => at.to_value(),
            Err(_) => Value::Null,
        }
    }

    fn as_raw_value(&self) -> Option<&Self::RawValueType> {
        Some(self)
    }
}

/// Seconds as a duration, for values a [`Field::int`] check already bounded; out of range it
/// saturates instead of panicking (`TimeDelta::seconds` panics), and the domain refuses it.
pub fn seconds(value: i64) -> TimeDelta {
    TimeDelta::try_seconds(value).unwrap_or(if value < 0 {
        TimeDelta::MIN
    } else {
        TimeDelta::MAX
    })
}

/// Keeps an error message from repeating a large value: a quoted value or single word longer
/// than a few dozen bytes is cut, and the whole message to [`MAX_ERROR_MESSAGE_BYTES`]. Short
/// messages are left alone.
pub fn bound_message(message: &mut String) {
    if message.len() <= MAX_ERROR_MESSAGE_BYTES {
        return;
    }
    let mut out = String::with_capacity(MAX_ERROR_MESSAGE_BYTES + 8);
    let mut rest = message.as_str();
    while let Some(c) = rest.chars().next() {
        if out.len() > MAX_ERROR_MESSAGE_BYTES {
            break;
        }
        if c == '"' || c == '`' {
            let inner = &rest[1..];
            let (value, consumed, closed) = match inner.find(c) {
                Some(end) => (&inner[..end], end + 2, true),
                None => (inner, rest.len(), false),
            };
            out.push(c);
            out.push_str(&shorten(value));
            if closed {
                out.push(c);
            }
            rest = &rest[consumed..];
        } else if c.is_whitespace() {
            out.push(c);
            rest = &rest[c.len_utf8()..];
        } else {
            let end = rest
                .find(|ch: char| ch.is_whitespace() || ch == '"' || ch == '`')
                .unwrap_or(rest.len());
            out.push_str(&shorten(&rest[..end]));
            rest = &rest[end..];
        }
    }
    if out.len() > MAX_ERROR_MESSAGE_BYTES || !rest.is_empty() {
        out.truncate(floor_boundary(&out, MAX_ERROR_MESSAGE_BYTES));
        out.push_str("… (cut)");
    }
    *message = out;
}

/// `run` itself, or its beginning and an ellipsis.
fn shorten(run: &str) -> Cow<'_, str> {
    if run.len() <= MAX_ECHO_BYTES {
        Cow::Borrowed(run)
    } else {
        let end = floor_boundary(run, MAX_ECHO_BYTES / 2);
        Cow::Owned(format!("{}… ({} bytes)", &run[..end], run.len()))
    }
}

/// The largest char boundary of `text` at or below `at`.
fn floor_boundary(text: &str, at: usize) -> usize {
    let mut end = at.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    end
}

/// What POST `/graphql` answers when its body is no GraphQL request (not JSON, the wrong
/// shape, a batch): `400` with the same error shape as every GraphQL error and code
/// `BAD_USER_INPUT`, where async-graphql-axum would answer with Rust `Debug` text.
pub struct BodyRejection(async_graphql::ParseRequestError);

impl From<async_graphql::ParseRequestError> for BodyRejection {
    fn from(err: async_graphql::ParseRequestError) -> Self {
        BodyRejection(err)
    }
}

impl BodyRejection {
    /// The status and the message for people.
    fn explain(&self) -> (StatusCode, String) {
        use async_graphql::ParseRequestError as E;
        const SHAPE: &str = "the request body must be a JSON object with a `query` string, and \
             optionally a `variables` object and an `operationName` string";
        match &self.0 {
            E::PayloadTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "the request body is too large".into(),
            ),
            E::UnsupportedBatch => (
                StatusCode::BAD_REQUEST,
                "batched requests are not supported: send one operation per request".into(),
            ),
            E::InvalidRequest(source) => {
                let json = source.downcast_ref::<serde_json::Error>();
                let message = match json.map(serde_json::Error::classify) {
                    Some(
                        serde_json::error::Category::Syntax | serde_json::error::Category::Eof,
                    ) => {
                        format!(
                            "the request body is not valid JSON: {}",
                            json.map(ToString::to_string).unwrap_or_default()
                        )
                    }
                    _ => SHAPE.to_owned(),
                };
                (StatusCode::BAD_REQUEST, message)
            }
            E::Io(_) => (
                StatusCode::BAD_REQUEST,
                "the request body could not be read".into(),
            ),
            other => (
                StatusCode::BAD_REQUEST,
                format!("the request is not a GraphQL request: {other}"),
            ),
        }
    }
}

impl IntoResponse for BodyRejection {
    fn into_response(self) -> Response {
        let (status, mut message) = self.explain();
        bound_message(&mut message);
        tracing::debug!(error = %self.0, "a request body that is no GraphQL request");
        let body = serde_json::json!({
            "data": null,
            "errors": [{ "message": message, "extensions": { "code": "BAD_USER_INPUT" } }],
        });
        (status, axum::Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(result: Result<(), ApiError>) -> (String, String) {
        match result {
            Err(ApiError::InvalidField { field, message }) => (field, message),
            other => panic!("expected an invalid field, got {other:?}"),
        }
    }

    #[test]
    fn strings_have_lengths_and_no_control_characters() {
        let input = Field::argument("input");
        assert!(
            input
                .at("reason")
                .text("rack move\n\tsecond line", Text::Reason)
                .is_ok()
        );
        let (field, message) = refused(input.at("reason").text(&"x".repeat(1025), Text::Reason));
        assert_eq!(field, "input.reason");
        assert_eq!(
            message,
            "`input.reason` is longer than 1024 bytes (1025 bytes)"
        );
        let (_, message) = refused(input.at("reason").text("a\0b", Text::Reason));
        assert_eq!(message, "`input.reason` contains a NUL byte");
        let (_, message) = refused(input.at("reason").text("  ", Text::Reason));
        assert_eq!(message, "`input.reason` must not be blank");
        let (_, message) = refused(input.at("hostname").text("a\nb", Text::HostnameFilter));
        assert_eq!(
            message,
            "`input.hostname` contains a control character (U+000A)"
        );
        assert!(input.at("hostname").text("", Text::HostnameFilter).is_ok());
        assert!(input.at("description").text("", Text::Description).is_ok());
        let (field, message) = refused(
            input
                .at("set")
                .index(2)
                .at("key")
                .text("-rack", Text::LabelKey),
        );
        assert_eq!(field, "input.set[2].key");
        assert!(
            message.starts_with("`input.set[2].key` is invalid: "),
            "{message}"
        );
        assert!(
            input
                .at("key")
                .text("example.com/rack", Text::LabelKey)
                .is_ok()
        );
        assert!(
            input
                .at("key")
                .text("Not A Key", Text::LabelKeyFilter)
                .is_ok()
        );
    }

    #[test]
    fn numbers_have_ranges() {
        let at = Field::argument("input").at("timeoutSeconds");
        assert!(at.int(21_600, COMMAND_TIMEOUT_SECONDS).is_ok());
        let (_, message) = refused(at.int(i64::MAX, COMMAND_TIMEOUT_SECONDS));
        assert_eq!(
            message,
            "`input.timeoutSeconds` must be between 1 and 21600 (got 9223372036854775807)"
        );
        assert!(at.int(0, COMMAND_TIMEOUT_SECONDS).is_err());
        assert_eq!(*JOIN_TOKEN_LIFETIME_SECONDS.end(), 365 * 86_400);
        assert_eq!(*COMMAND_TTL_SECONDS.end(), 30 * 86_400);
        assert_eq!(seconds(i64::MAX), TimeDelta::MAX);
        assert_eq!(seconds(i64::MIN), TimeDelta::MIN);
        assert_eq!(seconds(60), TimeDelta::minutes(1));
    }

    #[test]
    fn timestamps_lie_between_1970_and_9999() {
        let at = Field::argument("input").at("notBefore");
        let parse = |raw: &str| Timestamp::parse(Some(Value::String(raw.into()))).ok();
        assert!(
            at.time(Some(&parse("2030-01-01T00:00:00Z").expect("parses")))
                .is_ok()
        );
        assert!(
            at.time(Some(&parse("9999-12-31T23:59:59Z").expect("parses")))
                .is_ok()
        );
        for raw in [
            "+262143-12-31T23:59:59Z",
            "-262143-01-01T00:00:00Z",
            "1969-12-31T23:59:59Z",
            "soon",
        ] {
            let (field, _) = refused(at.time(Some(&parse(raw).expect("a string always parses"))));
            assert_eq!(field, "input.notBefore", "{raw}");
        }
        assert!(parse("10000-01-01T00:00:00Z").is_some_and(|t| t.value().is_err()));
    }

    #[test]
    fn json_is_bounded_and_has_no_nul_anywhere() {
        let at = Field::argument("input").at("params");
        assert!(
            at.json(&serde_json::json!({"level": 2, "sources": ["kern", "a\tb"]}))
                .is_err()
        );
        assert!(
            at.json(&serde_json::json!({"level": 2, "sources": ["kern"]}))
                .is_ok()
        );
        let (field, _) = refused(at.json(&serde_json::json!({"sources": ["kern", "a\u{0}b"]})));
        assert_eq!(field, "input.params.sources[1]");
        let (field, message) = refused(at.json(&serde_json::json!({"a\u{0}": 1})));
        assert_eq!(field, "input.params");
        assert_eq!(message, "`input.params` has a key that contains a NUL byte");
        let (_, message) =
            refused(at.json(&serde_json::json!({"x": "y".repeat(MAX_PARAMS_BYTES)})));
        assert!(message.contains("larger than 16384 bytes"), "{message}");
        let mut deep = serde_json::json!(1);
        for _ in 0..=MAX_PARAMS_DEPTH {
            deep = serde_json::json!([deep]);
        }
        assert!(at.json(&serde_json::json!([1])).is_ok());
        let (_, message) = refused(at.json(&deep));
        assert!(message.contains("deeper than 8"), "{message}");
    }

    #[test]
    fn lists_are_bounded() {
        let at = Field::argument("filter").at("siteId");
        let ids = vec![ID("site_a".into()); MAX_FILTER_VALUES + 1];
        let (field, _) = refused(at.list(&ids, MAX_FILTER_VALUES, Field::id));
        assert_eq!(field, "filter.siteId");
        let (field, _) = refused(at.list(
            &[ID("site_a".into()), ID("x".repeat(100))],
            MAX_FILTER_VALUES,
            Field::id,
        ));
        assert_eq!(field, "filter.siteId[1]");
    }

    /// A tripwire: every input object a resolver takes is wrapped in `Validated`, so none is
    /// read unchecked. (Resolver arguments sit one per line once rustfmt breaks a signature;
    /// a one-line `async fn` is checked too.)
    #[test]
    fn resolvers_take_input_objects_validated() {
        let is_input_type = |word: &str| {
            word.ends_with("Input") && word.starts_with(|c: char| c.is_ascii_uppercase())
        };
        let sources = [
            ("mutation.rs", include_str!("mutation.rs")),
            ("query.rs", include_str!("query.rs")),
            ("subscription.rs", include_str!("subscription.rs")),
        ];
        let mut bare = Vec::new();
        for (file, source) in sources {
            for (n, line) in source.lines().enumerate() {
                let line = line.trim();
                // An argument may carry its description on the same line.
                let line = match line.strip_prefix("#[") {
                    Some(rest) => rest
                        .split_once(")] ")
                        .map_or(line, |(_, argument)| argument),
                    None => line,
                };
                let argument = line
                    .strip_suffix(',')
                    .and_then(|l| l.split_once(": "))
                    .is_some_and(|(name, ty)| {
                        name.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                            && ty.split(|c: char| !c.is_alphanumeric()).any(is_input_type)
                    });
                let one_line_resolver = line.starts_with("async fn")
                    && line
                        .split(|c: char| !c.is_alphanumeric())
                        .any(is_input_type);
                if (argument || one_line_resolver) && !line.contains("Validated<") {
                    bare.push(format!("{file}:{}: {line}", n + 1));
                }
            }
        }
        assert!(
            bare.is_empty(),
            "input objects taken unchecked:\n{}",
            bare.join("\n")
        );
    }

    #[test]
    fn long_echoes_are_cut_and_short_messages_kept() {
        let mut short = "`node_x` is not a valid NodeId id".to_owned();
        bound_message(&mut short);
        assert_eq!(short, "`node_x` is not a valid NodeId id");

        let big = "y".repeat(100_000);
        let mut quoted = format!(
            "Invalid value for argument \"input.move\", enumeration type \"ProvisionMove\" does not contain the value \"{big}\""
        );
        bound_message(&mut quoted);
        assert!(quoted.len() < 300, "{quoted}");
        assert!(quoted.starts_with("Invalid value for argument \"input.move\", enumeration type \"ProvisionMove\" does not contain the value \"yyyy"), "{quoted}");
        assert!(quoted.ends_with("… (100000 bytes)\""), "{quoted}");

        let mut word =
            format!(" --> 1:24\n  |\n1 | {{ viewer }} {big}\n  | ^---\n  |\n  = expected EOI");
        bound_message(&mut word);
        assert!(word.len() < 300 && word.ends_with("expected EOI"), "{word}");

        let mut many = "word ".repeat(1000);
        bound_message(&mut many);
        assert!(
            many.len() <= MAX_ERROR_MESSAGE_BYTES + 16 && many.ends_with("… (cut)"),
            "{many}"
        );

        let mut unicode = format!("\"{}\"", "é".repeat(50_000));
        bound_message(&mut unicode);
        assert!(unicode.len() < 100, "{unicode}");
    }
}
