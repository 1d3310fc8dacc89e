//! [`TensorBoardTracker`]: TensorBoard's event file, written in its documented record format, and
//! [`read_events`] to read one back.
//!
//! An event file is a sequence of TFRecords (`u64` length, masked CRC-32C of the length, the bytes, masked CRC-32C
//! of the bytes), each holding one `tensorflow.Event` protocol buffer: the first names the file version, the
//! others carry a `Summary` of tagged scalars or texts. Only the handful of protobuf fields TensorBoard needs for
//! scalars and texts are written, by hand, so no protobuf compiler is needed to build this crate.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Record, Tracker, TrackerInit, Value, now};
use crate::error::{Error, Result, io};

/// Writes `<logging_dir>/events.out.tfevents.<time>.<host>.<pid>.<n>`: numbers as scalars (TensorBoard's
/// Scalars tab), texts with the text plugin (Text tab, tag `<name>/text_summary` as PyTorch writes it). The
/// configuration goes to `hparams.yml` beside it (as Accelerate's tracker writes it) and to a text summary
/// `hparams`. Every record is flushed when logged. Open it with `tensorboard --logdir <project_dir>`.
pub struct TensorBoardTracker {
    path: PathBuf,
    dir: PathBuf,
    file: BufWriter<File>,
}

impl TensorBoardTracker {
    /// Creates a new event file in the logging folder (a new file per run, as TensorBoard expects).
    pub fn new(init: &TrackerInit) -> Result<Self> {
        static FILES: AtomicU64 = AtomicU64::new(0);
        let dir = init.require_logging_dir("tensorboard")?;
        let host = crate::backend::sys::hostname();
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            now().floor() as u64,
            std::process::id(),
            FILES.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io("creating", &path))?;
        let mut tracker = Self {
            path,
            dir,
            file: BufWriter::new(file),
        };
        let mut header = Vec::new();
        proto::double(&mut header, 1, now());
        proto::bytes(&mut header, 3, b"brain.Event:2");
        tracker.write_record(&header)?;
        Ok(tracker)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let result = self
            .file
            .write_all(&len)
            .and_then(|()| self.file.write_all(&masked_crc(&len).to_le_bytes()))
            .and_then(|()| self.file.write_all(data))
            .and_then(|()| self.file.write_all(&masked_crc(data).to_le_bytes()))
            .and_then(|()| self.file.flush());
        result.map_err(io("writing", &self.path))
    }

    fn write_summary(
        &mut self,
        step: u64,
        wall_time: f64,
        values: &[(String, Value)],
    ) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in values {
            let mut entry = Vec::new();
            match value {
                Value::Text(text) => {
                    proto::bytes(&mut entry, 1, format!("{tag}/text_summary").as_bytes());
                    proto::message(&mut entry, 8, &text_tensor(text));
                    proto::message(&mut entry, 9, &plugin_metadata("text"));
                }
                number => {
                    proto::bytes(&mut entry, 1, tag.as_bytes());
                    proto::float(&mut entry, 2, number.as_f64().unwrap_or(f64::NAN) as f32);
                }
            }
            proto::message(&mut summary, 1, &entry);
        }
        let mut event = Vec::new();
        proto::double(&mut event, 1, wall_time);
        proto::varint_field(&mut event, 2, step);
        proto::message(&mut event, 5, &summary);
        self.write_record(&event)
    }
}

impl Tracker for TensorBoardTracker {
    fn name(&self) -> &str {
        "tensorboard"
    }

    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        let path = self.dir.join("hparams.yml");
        let yaml = serde_yaml_ng::to_string(config).map_err(|e| {
            Error::InvalidArgument(format!("the configuration cannot be written as YAML: {e}"))
        })?;
        std::fs::write(&path, &yaml).map_err(io("writing", &path))?;
        let table = config_table(config);
        self.write_summary(0, now(), &[("hparams".into(), Value::Text(table))])
    }

    fn log(&mut self, record: &Record<'_>) -> Result<()> {
        self.write_summary(record.step, record.wall_time, record.values)
    }

    fn finish(&mut self) -> Result<()> {
        self.file.flush().map_err(io("writing", &self.path))
    }
}

/// The configuration as a Markdown table, as the text plugin renders it.
fn config_table(config: &serde_json::Value) -> String {
    let mut table = String::from("| parameter | value |\n|---|---|\n");
    match config {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                table.push_str(&format!("| {k} | {v} |\n"));
            }
        }
        other => table.push_str(&format!("| config | {other} |\n")),
    }
    table
}

/// TFRecord's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// A scalar string tensor (`TensorProto` with dtype `DT_STRING`, shape `[1]`), as PyTorch's `add_text` writes.
fn text_tensor(text: &str) -> Vec<u8> {
    const DT_STRING: u64 = 7;
    let mut dim = Vec::new();
    proto::varint_field(&mut dim, 1, 1);
    let mut shape = Vec::new();
    proto::message(&mut shape, 2, &dim);
    let mut tensor = Vec::new();
    proto::varint_field(&mut tensor, 1, DT_STRING);
    proto::message(&mut tensor, 2, &shape);
    proto::bytes(&mut tensor, 8, text.as_bytes());
    tensor
}

/// `SummaryMetadata { plugin_data { plugin_name } }`.
fn plugin_metadata(plugin: &str) -> Vec<u8> {
    let mut data = Vec::new();
    proto::bytes(&mut data, 1, plugin.as_bytes());
    let mut metadata = Vec::new();
    proto::message(&mut metadata, 1, &data);
    metadata
}

/// The protocol-buffer wire format, for the few field types an event needs.
mod proto {
    pub(super) const VARINT: u8 = 0;
    pub(super) const FIXED64: u8 = 1;
    pub(super) const LEN: u8 = 2;
    pub(super) const FIXED32: u8 = 5;

    pub(super) fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
        varint(out, (u64::from(field) << 3) | u64::from(wire));
    }

    pub(super) fn varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
        key(out, field, VARINT);
        varint(out, v);
    }

    pub(super) fn double(out: &mut Vec<u8>, field: u32, v: f64) {
        key(out, field, FIXED64);
        out.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn float(out: &mut Vec<u8>, field: u32, v: f32) {
        key(out, field, FIXED32);
        out.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn bytes(out: &mut Vec<u8>, field: u32, v: &[u8]) {
        key(out, field, LEN);
        varint(out, v.len() as u64);
        out.extend_from_slice(v);
    }

    pub(super) fn message(out: &mut Vec<u8>, field: u32, v: &[u8]) {
        bytes(out, field, v);
    }

    /// One decoded field: its number and value.
    pub(super) enum Field<'a> {
        Varint(u64),
        Fixed64([u8; 8]),
        Len(&'a [u8]),
        Fixed32([u8; 4]),
    }

    /// The fields of one message, in order; `Err` names what is malformed.
    pub(super) fn fields(mut data: &[u8]) -> Result<Vec<(u32, Field<'_>)>, String> {
        fn read_varint(data: &mut &[u8]) -> Result<u64, String> {
            let mut value = 0u64;
            for shift in (0..64).step_by(7) {
                let (&byte, rest) = data.split_first().ok_or("truncated varint")?;
                *data = rest;
                value |= u64::from(byte & 0x7f) << shift;
                if byte < 0x80 {
                    return Ok(value);
                }
            }
            Err("varint longer than 10 bytes".into())
        }
        fn take<'a>(data: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
            if data.len() < n {
                return Err(format!("field of {n} bytes with {} left", data.len()));
            }
            let (head, rest) = data.split_at(n);
            *data = rest;
            Ok(head)
        }
        let mut out = Vec::new();
        while !data.is_empty() {
            let key = read_varint(&mut data)?;
            let field = u32::try_from(key >> 3).map_err(|_| "field number too large")?;
            let value = match (key & 7) as u8 {
                VARINT => Field::Varint(read_varint(&mut data)?),
                FIXED64 => Field::Fixed64(take(&mut data, 8)?.try_into().expect("8 bytes")),
                LEN => {
                    let n = read_varint(&mut data)?;
                    let n = usize::try_from(n).map_err(|_| "length too large")?;
                    Field::Len(take(&mut data, n)?)
                }
                FIXED32 => Field::Fixed32(take(&mut data, 4)?.try_into().expect("4 bytes")),
                other => return Err(format!("unsupported wire type {other}")),
            };
            out.push((field, value));
        }
        Ok(out)
    }
}

/// One event read back from an event file.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    /// The step.
    pub step: u64,
    /// The file version (`brain.Event:2`), on the first event only.
    pub file_version: Option<String>,
    /// The summary's values: tag and value (scalars as [`Value::Float`], texts as [`Value::Text`] under the tag
    /// they were logged with, without `/text_summary`).
    pub values: Vec<(String, Value)>,
}

/// Reads every event of a TensorBoard event file, checking each record's checksums.
///
/// # Errors
/// The file cannot be read, or a record is truncated, fails its checksum or does not decode; the message names
/// the file and the record's byte offset.
pub fn read_events(path: impl AsRef<Path>) -> Result<Vec<Event>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(io("reading", path))?;
    let bad = |offset: usize, reason: String| Error::Tracker {
        tracker: "tensorboard".into(),
        reason: format!(
            "event file {}: record at byte {offset}: {reason}",
            path.display()
        ),
    };
    let mut events = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < 12 {
            return Err(bad(at, "truncated header".into()));
        }
        let len_bytes = &rest[..8];
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
        if u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes")) != masked_crc(len_bytes) {
            return Err(bad(at, "length checksum mismatch".into()));
        }
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= rest.len().saturating_sub(16))
            .ok_or_else(|| bad(at, format!("record of {len} bytes runs past the end")))?;
        let data = &rest[12..12 + len];
        let crc = u32::from_le_bytes(rest[12 + len..16 + len].try_into().expect("4 bytes"));
        if crc != masked_crc(data) {
            return Err(bad(at, "data checksum mismatch".into()));
        }
        events.push(decode_event(data).map_err(|reason| bad(at, reason))?);
        at += 16 + len;
    }
    Ok(events)
}

fn decode_event(data: &[u8]) -> std::result::Result<Event, String> {
    use proto::Field;
    let mut event = Event {
        wall_time: 0.0,
        step: 0,
        file_version: None,
        values: Vec::new(),
    };
    for (field, value) in proto::fields(data)? {
        match (field, value) {
            (1, Field::Fixed64(b)) => event.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => event.step = v,
            (3, Field::Len(b)) => {
                event.file_version = Some(String::from_utf8_lossy(b).into_owned())
            }
            (5, Field::Len(summary)) => {
                for (field, value) in proto::fields(summary)? {
                    if let (1, Field::Len(entry)) = (field, value) {
                        event.values.push(decode_value(entry)?);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(event)
}

fn decode_value(entry: &[u8]) -> std::result::Result<(String, Value), String> {
    use proto::Field;
    let (mut tag, mut value) = (String::new(), None);
    for (field, v) in proto::fields(entry)? {
        match (field, v) {
            (1, Field::Len(b)) => tag = String::from_utf8_lossy(b).into_owned(),
            (2, Field::Fixed32(b)) => value = Some(Value::Float(f64::from(f32::from_le_bytes(b)))),
            (8, Field::Len(tensor)) => {
                for (field, v) in proto::fields(tensor)? {
                    if let (8, Field::Len(s)) = (field, v) {
                        value = Some(Value::Text(String::from_utf8_lossy(s).into_owned()));
                    }
                }
            }
            _ => {}
        }
    }
    let tag = tag
        .strip_suffix("/text_summary")
        .map_or(tag.clone(), str::to_string);
    let value =
        value.ok_or_else(|| format!("summary value {tag:?} holds neither a scalar nor a text"))?;
    Ok((tag, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflow() {
        // Values computed outside this code (a bitwise CRC-32C and TensorFlow's `Mask`, ((crc >> 15) |
        // (crc << 17)) + 0xa282ead8): the check value of "123456789", TensorFlow's crc32c_test vectors, and the
        // masked CRC of the length field of a 24-byte record.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c::crc32c(b"foo"), 0xcfc4_ae1d);
        assert_eq!(masked_crc(b"foo"), 0xfebe_8a61);
        assert_eq!(masked_crc(&24u64.to_le_bytes()), 0x224b_7fa3);
    }

    #[test]
    fn varints_round_trip() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut out = Vec::new();
            proto::varint_field(&mut out, 2, v);
            let fields = proto::fields(&out).unwrap();
            assert!(matches!(fields[..], [(2, proto::Field::Varint(x))] if x == v));
        }
    }

    #[test]
    fn a_corrupted_record_is_reported_with_its_offset() {
        let dir = std::env::temp_dir().join(format!("tb-unit-{}", std::process::id()));
        let init = TrackerInit {
            project_name: "run".into(),
            logging_dir: Some(dir.clone()),
            process_index: 0,
        };
        let mut tracker = TensorBoardTracker::new(&init).unwrap();
        let values = [("loss".to_string(), Value::Float(0.5))];
        tracker
            .log(&Record {
                step: 4,
                wall_time: 1.0,
                values: &values,
            })
            .unwrap();
        tracker.finish().unwrap();
        let path = tracker.path().to_path_buf();
        let events = read_events(&path).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        assert_eq!(events[1].step, 4);
        assert_eq!(events[1].values, values.to_vec());

        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains("data checksum mismatch"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
