//! The on-disk spill: a bounded, append-only queue of records that could not reach Kafka yet.
//!
//! Layout: `segment-<seq>.spill` files plus a `cursor` file naming the first record not yet
//! acknowledged by Kafka. Each record is a frame `[len u32 LE][crc32 u32 LE][body]`, body =
//! `[version u8][topic u8][id 16 bytes][key_len u32 LE][key][payload]`. A record leaves the spill
//! (the cursor moves past it) only after Kafka acknowledged it, so a crash replays it again
//! (at-least-once; the id lets consumers deduplicate). On open, a torn or corrupt frame is
//! skipped and counted: a bad checksum with a plausible length skips just that frame, a
//! length running past the end of the file truncates the segment there.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use uuid::Uuid;

use crate::records::Topic;

const FRAME_HEADER_BYTES: u64 = 8;
const BODY_FIXED_BYTES: usize = 1 + 1 + 16 + 4;
const FORMAT_VERSION: u8 = 1;
/// Frames above this length are treated as corruption, not as records.
pub(crate) const MAX_FRAME_BYTES: u32 = 256 * 1024 * 1024;

/// One record waiting in the spill.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SpillRecord {
    pub topic: Topic,
    pub id: Uuid,
    pub key: String,
    pub payload: Bytes,
}

/// Errors of the spill.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpillError {
    #[error("spill is full ({used} of {max} bytes used)")]
    Full { used: u64, max: u64 },
    #[error("spill I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SpillError + '_ {
    move |source| SpillError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Position of the next unacknowledged record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub seq: u64,
    pub offset: u64,
}

#[derive(Debug)]
struct Segment {
    seq: u64,
    len: u64,
}

/// What `read_frame` found at a position.
#[derive(Debug)]
enum Frame {
    Record(SpillRecord, u64),
    /// Checksum or body malformed, but the length is plausible: skip to the returned position.
    Corrupt(u64),
    /// The frame runs past the end (torn write) or its length is absurd.
    Torn,
    End,
}

pub(crate) fn encode_frame(rec: &SpillRecord) -> Vec<u8> {
    let key = rec.key.as_bytes();
    let body_len = BODY_FIXED_BYTES + key.len() + rec.payload.len();
    let mut out = Vec::with_capacity(FRAME_HEADER_BYTES as usize + body_len);
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.push(FORMAT_VERSION);
    out.push(rec.topic.as_u8());
    out.extend_from_slice(rec.id.as_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&rec.payload);
    let crc = crc32fast::hash(&out[FRAME_HEADER_BYTES as usize..]);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
    out
}

fn decode_body(body: &[u8]) -> Option<SpillRecord> {
    if body.len() < BODY_FIXED_BYTES || body[0] != FORMAT_VERSION {
        return None;
    }
    let topic = Topic::from_u8(body[1])?;
    let id = Uuid::from_slice(&body[2..18]).ok()?;
    let key_len = u32::from_le_bytes(body[18..22].try_into().ok()?) as usize;
    let rest = &body[22..];
    if key_len > rest.len() {
        return None;
    }
    let key = std::str::from_utf8(&rest[..key_len]).ok()?.to_string();
    let payload = Bytes::copy_from_slice(&rest[key_len..]);
    Some(SpillRecord {
        topic,
        id,
        key,
        payload,
    })
}

fn read_frame<R: Read>(r: &mut R, pos: u64, file_len: u64) -> std::io::Result<Frame> {
    if pos >= file_len {
        return Ok(Frame::End);
    }
    if pos + FRAME_HEADER_BYTES > file_len {
        return Ok(Frame::Torn);
    }
    let mut header = [0u8; 8];
    r.read_exact(&mut header)?;
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    if len > MAX_FRAME_BYTES || pos + FRAME_HEADER_BYTES + u64::from(len) > file_len {
        return Ok(Frame::Torn);
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    let next = pos + FRAME_HEADER_BYTES + u64::from(len);
    if crc32fast::hash(&body) != crc {
        return Ok(Frame::Corrupt(next));
    }
    Ok(match decode_body(&body) {
        Some(rec) => Frame::Record(rec, next),
        None => Frame::Corrupt(next),
    })
}

/// The spill directory, opened. Not thread-safe: the log keeps it behind a mutex.
#[derive(Debug)]
pub(crate) struct Spill {
    dir: PathBuf,
    max_bytes: u64,
    segment_max_bytes: u64,
    segments: VecDeque<Segment>,
    writer: Option<File>,
    cursor: Cursor,
    pending_records: u64,
    disk_bytes: u64,
    unsynced: bool,
    corrupt_records: u64,
}

fn segment_name(seq: u64) -> String {
    format!("segment-{seq:020}.spill")
}

fn parse_segment_name(name: &str) -> Option<u64> {
    name.strip_prefix("segment-")?
        .strip_suffix(".spill")?
        .parse()
        .ok()
}

impl Spill {
    /// Opens (or creates) the spill in `dir`, validating every pending frame.
    pub fn open(dir: &Path, max_bytes: u64, segment_max_bytes: u64) -> Result<Spill, SpillError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut seqs = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_err(dir))? {
            let entry = entry.map_err(io_err(dir))?;
            if let Some(seq) = entry.file_name().to_str().and_then(parse_segment_name) {
                seqs.push(seq);
            }
        }
        seqs.sort_unstable();
        let cursor_path = dir.join("cursor");
        let stored_cursor = fs::read_to_string(&cursor_path).ok().and_then(|s| {
            let mut it = s.split_whitespace();
            let seq = it.next()?.parse().ok()?;
            let offset = it.next()?.parse().ok()?;
            Some(Cursor { seq, offset })
        });
        let mut spill = Spill {
            dir: dir.to_path_buf(),
            max_bytes,
            segment_max_bytes: segment_max_bytes.max(4096),
            segments: VecDeque::new(),
            writer: None,
            cursor: Cursor { seq: 0, offset: 0 },
            pending_records: 0,
            disk_bytes: 0,
            unsynced: false,
            corrupt_records: 0,
        };
        let first_seq = seqs.first().copied().unwrap_or(0);
        let mut cursor = match stored_cursor {
            Some(c) if c.seq >= first_seq => c,
            _ => Cursor {
                seq: first_seq,
                offset: 0,
            },
        };
        for seq in seqs {
            let path = dir.join(segment_name(seq));
            if seq < cursor.seq {
                fs::remove_file(&path).map_err(io_err(&path))?;
                continue;
            }
            let start = if seq == cursor.seq { cursor.offset } else { 0 };
            let (len, records, corrupt) = Self::validate_segment(&path, start)?;
            if seq == cursor.seq && cursor.offset > len {
                cursor.offset = len;
            }
            spill.pending_records += records;
            spill.corrupt_records += corrupt;
            spill.disk_bytes += len;
            spill.segments.push_back(Segment { seq, len });
        }
        if spill.segments.is_empty() {
            cursor = Cursor {
                seq: cursor.seq,
                offset: 0,
            };
        }
        spill.cursor = cursor;
        Ok(spill)
    }

    /// Scans a segment from `start`; truncates a torn tail. Returns (length, records, corrupt).
    fn validate_segment(path: &Path, start: u64) -> Result<(u64, u64, u64), SpillError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err(path))?;
        let file_len = file.metadata().map_err(io_err(path))?.len();
        let mut reader = BufReader::new(&file);
        let mut pos = start.min(file_len);
        reader.seek(SeekFrom::Start(pos)).map_err(io_err(path))?;
        let (mut records, mut corrupt) = (0u64, 0u64);
        loop {
            match read_frame(&mut reader, pos, file_len).map_err(io_err(path))? {
                Frame::Record(_, next) => {
                    records += 1;
                    pos = next;
                }
                Frame::Corrupt(next) => {
                    corrupt += 1;
                    tracing::warn!(path = %path.display(), offset = pos, "Corrupt spill record skipped.");
                    pos = next;
                }
                Frame::Torn => {
                    corrupt += 1;
                    tracing::warn!(path = %path.display(), offset = pos, "Torn spill tail truncated.");
                    file.set_len(pos).map_err(io_err(path))?;
                    file.sync_all().map_err(io_err(path))?;
                    return Ok((pos, records, corrupt));
                }
                Frame::End => return Ok((file_len, records, corrupt)),
            }
        }
    }

    /// Records waiting to be replayed.
    pub fn pending_records(&self) -> u64 {
        self.pending_records
    }

    /// Bytes the spill occupies on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    /// Corrupt or torn frames skipped since open.
    pub fn corrupt_records(&self) -> u64 {
        self.corrupt_records
    }

    /// Appends one record (not yet fsynced; see [`Spill::sync`]).
    pub fn append(&mut self, rec: &SpillRecord) -> Result<u64, SpillError> {
        let frame = encode_frame(rec);
        let frame_len = frame.len() as u64;
        if self.disk_bytes + frame_len > self.max_bytes {
            return Err(SpillError::Full {
                used: self.disk_bytes,
                max: self.max_bytes,
            });
        }
        let need_new = match (self.segments.back(), self.writer.is_some()) {
            (Some(seg), true) => seg.len > 0 && seg.len + frame_len > self.segment_max_bytes,
            _ => true,
        };
        if need_new {
            self.rotate()?;
        }
        let (Some(seg), Some(writer)) = (self.segments.back_mut(), self.writer.as_mut()) else {
            return Err(SpillError::Io {
                path: self.dir.clone(),
                source: std::io::Error::other("no open spill segment"),
            });
        };
        let path = self.dir.join(segment_name(seg.seq));
        if let Err(e) = writer.write_all(&frame) {
            // Cut off a partial frame so the segment stays well-formed.
            let _ = writer.set_len(seg.len);
            return Err(io_err(&path)(e));
        }
        seg.len += frame_len;
        self.disk_bytes += frame_len;
        self.pending_records += 1;
        self.unsynced = true;
        Ok(frame_len)
    }

    fn rotate(&mut self) -> Result<(), SpillError> {
        self.sync()?;
        let seq = match self.segments.back() {
            Some(seg) => seg.seq + 1,
            None => self.cursor.seq.max(1),
        };
        let path = self.dir.join(segment_name(seq));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io_err(&path))?;
        if self.segments.is_empty() {
            self.cursor = Cursor { seq, offset: 0 };
        }
        self.segments.push_back(Segment { seq, len: 0 });
        self.writer = Some(file);
        Ok(())
    }

    /// Makes appended records durable.
    pub fn sync(&mut self) -> Result<(), SpillError> {
        if self.unsynced {
            if let (Some(w), Some(seg)) = (self.writer.as_ref(), self.segments.back()) {
                w.sync_data()
                    .map_err(io_err(&self.dir.join(segment_name(seg.seq))))?;
            }
            self.unsynced = false;
        }
        Ok(())
    }

    /// Reads up to `max` pending records from the cursor, without removing them. Returns the
    /// records and the position after them (pass it to [`Spill::commit`] once Kafka acked them).
    pub fn peek(&mut self, max: usize) -> Result<(Vec<SpillRecord>, Cursor), SpillError> {
        self.skip_finished_segments()?;
        let mut out = Vec::new();
        let Some(seg) = self.segments.front() else {
            return Ok((out, self.cursor));
        };
        let path = self.dir.join(segment_name(seg.seq));
        let file = File::open(&path).map_err(io_err(&path))?;
        let mut reader = BufReader::with_capacity(256 * 1024, file);
        let mut pos = self.cursor.offset;
        reader.seek(SeekFrom::Start(pos)).map_err(io_err(&path))?;
        while out.len() < max {
            match read_frame(&mut reader, pos, seg.len).map_err(io_err(&path))? {
                Frame::Record(rec, next) => {
                    out.push(rec);
                    pos = next;
                }
                Frame::Corrupt(next) => pos = next,
                Frame::Torn | Frame::End => {
                    pos = seg.len;
                    break;
                }
            }
        }
        Ok((
            out,
            Cursor {
                seq: seg.seq,
                offset: pos,
            },
        ))
    }

    /// Marks `records` records up to `to` as delivered and frees finished segments.
    pub fn commit(&mut self, to: Cursor, records: u64) -> Result<(), SpillError> {
        self.cursor = to;
        self.pending_records = self.pending_records.saturating_sub(records);
        self.skip_finished_segments()?;
        self.persist_cursor()
    }

    /// Deletes segments the cursor has fully passed; resets the spill when nothing is pending.
    fn skip_finished_segments(&mut self) -> Result<(), SpillError> {
        loop {
            let Some(front) = self.segments.front() else {
                return Ok(());
            };
            let is_last = self.segments.len() == 1;
            let finished = self.cursor.seq > front.seq
                || (self.cursor.seq == front.seq && self.cursor.offset >= front.len);
            if !finished {
                return Ok(());
            }
            if is_last {
                // Everything is delivered: drop the tail segment too so the disk is freed.
                self.writer = None;
            }
            let seq = front.seq;
            let len = front.len;
            let path = self.dir.join(segment_name(seq));
            fs::remove_file(&path).map_err(io_err(&path))?;
            self.segments.pop_front();
            self.disk_bytes = self.disk_bytes.saturating_sub(len);
            self.cursor = Cursor {
                seq: seq + 1,
                offset: 0,
            };
            if is_last {
                self.pending_records = 0;
                self.persist_cursor()?;
                return Ok(());
            }
        }
    }

    fn persist_cursor(&self) -> Result<(), SpillError> {
        let tmp = self.dir.join("cursor.tmp");
        let dst = self.dir.join("cursor");
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        writeln!(f, "{} {}", self.cursor.seq, self.cursor.offset).map_err(io_err(&tmp))?;
        f.sync_data().map_err(io_err(&tmp))?;
        fs::rename(&tmp, &dst).map_err(io_err(&dst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: u32) -> SpillRecord {
        SpillRecord {
            topic: Topic::Interactions,
            id: Uuid::now_v7(),
            key: format!("key-{i}"),
            payload: Bytes::from(format!("{{\"n\":{i}}}")),
        }
    }

    fn drain(spill: &mut Spill) -> Vec<SpillRecord> {
        let mut all = Vec::new();
        loop {
            let (batch, to) = spill.peek(7).unwrap();
            let n = batch.len() as u64;
            let done = batch.is_empty() && spill.pending_records() == 0;
            all.extend(batch);
            spill.commit(to, n).unwrap();
            if done {
                return all;
            }
        }
    }

    #[test]
    fn frame_round_trips() {
        let r = rec(1);
        let frame = encode_frame(&r);
        let len = frame.len() as u64;
        let mut cur = std::io::Cursor::new(frame);
        match read_frame(&mut cur, 0, len).unwrap() {
            Frame::Record(back, next) => {
                assert_eq!(back, r);
                assert_eq!(next, len);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn replays_in_order_across_segments() {
        let dir = tempfile::tempdir().unwrap();
        let mut spill = Spill::open(dir.path(), 1 << 20, 4096).unwrap();
        let recs: Vec<_> = (0..200).map(rec).collect();
        for r in &recs {
            spill.append(r).unwrap();
        }
        assert!(spill.segments.len() > 1, "should have rotated");
        assert_eq!(spill.pending_records(), 200);
        let back = drain(&mut spill);
        assert_eq!(back, recs);
        assert_eq!(spill.pending_records(), 0);
        assert_eq!(spill.disk_bytes(), 0);
        let files = fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                let e = e.as_ref().unwrap();
                parse_segment_name(e.file_name().to_str().unwrap()).is_some()
            })
            .count();
        assert_eq!(files, 0, "delivered segments are deleted");
    }

    #[test]
    fn reopen_resumes_after_committed_cursor() {
        let dir = tempfile::tempdir().unwrap();
        let recs: Vec<_> = (0..50).map(rec).collect();
        {
            let mut spill = Spill::open(dir.path(), 1 << 20, 1024).unwrap();
            for r in &recs {
                spill.append(r).unwrap();
            }
            let (batch, to) = spill.peek(5).unwrap();
            assert_eq!(batch, recs[..5].to_vec());
            spill.commit(to, 5).unwrap();
            // Peeked but never acked: must come back after a restart.
            let _ = spill.peek(5).unwrap();
            spill.sync().unwrap();
        }
        let mut spill = Spill::open(dir.path(), 1 << 20, 1024).unwrap();
        assert_eq!(spill.pending_records(), 45);
        assert_eq!(drain(&mut spill), recs[5..].to_vec());
        // Appending after a full drain starts a fresh segment.
        spill.append(&recs[0]).unwrap();
        assert_eq!(drain(&mut spill), vec![recs[0].clone()]);
    }

    #[test]
    fn torn_tail_is_truncated_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let recs: Vec<_> = (0..10).map(rec).collect();
        {
            let mut spill = Spill::open(dir.path(), 1 << 20, 1 << 20).unwrap();
            for r in &recs {
                spill.append(r).unwrap();
            }
            spill.sync().unwrap();
        }
        let seg = dir.path().join(segment_name(1));
        let len = fs::metadata(&seg).unwrap().len();
        // Simulate a crash halfway through writing the last frame.
        let f = OpenOptions::new().write(true).open(&seg).unwrap();
        f.set_len(len - 5).unwrap();
        let mut spill = Spill::open(dir.path(), 1 << 20, 1 << 20).unwrap();
        assert_eq!(spill.corrupt_records(), 1);
        assert_eq!(spill.pending_records(), 9);
        assert_eq!(drain(&mut spill), recs[..9].to_vec());
    }

    #[test]
    fn corrupt_middle_record_is_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let recs: Vec<_> = (0..3).map(rec).collect();
        let frame_len;
        {
            let mut spill = Spill::open(dir.path(), 1 << 20, 1 << 20).unwrap();
            frame_len = spill.append(&recs[0]).unwrap();
            spill.append(&recs[1]).unwrap();
            spill.append(&recs[2]).unwrap();
            spill.sync().unwrap();
        }
        let seg = dir.path().join(segment_name(1));
        let mut bytes = fs::read(&seg).unwrap();
        // Flip a payload byte of the second record.
        let i = (frame_len + frame_len - 2) as usize;
        bytes[i] ^= 0xff;
        fs::write(&seg, bytes).unwrap();
        let mut spill = Spill::open(dir.path(), 1 << 20, 1 << 20).unwrap();
        assert_eq!(spill.corrupt_records(), 1);
        assert_eq!(spill.pending_records(), 2);
        assert_eq!(drain(&mut spill), vec![recs[0].clone(), recs[2].clone()]);
    }

    #[test]
    fn absurd_length_truncates() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut spill = Spill::open(dir.path(), 1 << 20, 1 << 20).unwrap();
            spill.append(&rec(0)).unwrap();
            spill.sync().unwrap();
        }
        let seg = dir.path().join(segment_name(1));
        let mut f = OpenOptions::new().append(true).open(&seg).unwrap();
        f.write_all(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 1, 2, 3])
            .unwrap();
        let mut spill = Spill::open(dir.path(), 1 << 20, 1 << 20).unwrap();
        assert_eq!(spill.corrupt_records(), 1);
        assert_eq!(drain(&mut spill).len(), 1);
    }

    #[test]
    fn full_spill_refuses_records() {
        let dir = tempfile::tempdir().unwrap();
        let mut spill = Spill::open(dir.path(), 300, 4096).unwrap();
        let mut accepted = 0;
        let mut refused = 0;
        for i in 0..20 {
            match spill.append(&rec(i)) {
                Ok(_) => accepted += 1,
                Err(SpillError::Full { .. }) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(accepted > 0 && refused > 0);
        assert!(spill.disk_bytes() <= 300);
        assert_eq!(spill.pending_records(), accepted);
    }
}
